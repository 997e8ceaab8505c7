//! Every `HOROVOD_*` variable of Horovod's documentation, and what hvd makes of it: read with
//! Horovod's meaning, read by the package build, or without meaning here (and why).
//!
//! `horovodrun` checks its own environment against this table at start, so a setting carried
//! over from Horovod is either honoured or named with the reason, never silently dropped.

/// What hvd does with one of Horovod's variables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Meaning {
    /// Read at run time with Horovod's meaning (by `horovodrun` or by the workers).
    Runtime,
    /// A switch of Horovod's package build (`HOROVOD_WITH_*`, `HOROVOD_WITHOUT_*`): hvd's
    /// package always has PyTorch over Gloo-style TCP, so asking for those is met and asking
    /// for another part cannot be ([`build_switch`] says which).
    Build,
    /// A build setting with no meaning for hvd's build (paths and options of libraries hvd does
    /// not link): ignored, with this reason.
    BuildIgnored(&'static str),
    /// Meaningless at run time here, with this reason; `horovodrun` warns about it.
    Ignored(&'static str),
}

/// Horovod's variables, by name. Variables named by prefix (`HOROVOD_WITH_`,
/// `HOROVOD_WITHOUT_`) are judged by [`build_switch`].
pub const HOROVOD_VARS: &[(&str, Meaning)] = &[
    ("HOROVOD_RANK", Meaning::Runtime),
    ("HOROVOD_SIZE", Meaning::Runtime),
    ("HOROVOD_LOCAL_RANK", Meaning::Runtime),
    ("HOROVOD_LOCAL_SIZE", Meaning::Runtime),
    ("HOROVOD_CROSS_RANK", Meaning::Runtime),
    ("HOROVOD_CROSS_SIZE", Meaning::Runtime),
    ("HOROVOD_HOSTNAME", Meaning::Runtime),
    ("HOROVOD_ELASTIC", Meaning::Runtime),
    ("HOROVOD_START_TIMEOUT", Meaning::Runtime),
    ("HOROVOD_ELASTIC_TIMEOUT", Meaning::Runtime),
    ("HOROVOD_CYCLE_TIME", Meaning::Runtime),
    ("HOROVOD_FUSION_THRESHOLD", Meaning::Runtime),
    ("HOROVOD_CACHE_CAPACITY", Meaning::Runtime),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", Meaning::Runtime),
    ("HOROVOD_HIERARCHICAL_ALLGATHER", Meaning::Runtime),
    ("HOROVOD_AUTOTUNE", Meaning::Runtime),
    ("HOROVOD_AUTOTUNE_LOG", Meaning::Runtime),
    ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", Meaning::Runtime),
    ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", Meaning::Runtime),
    ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", Meaning::Runtime),
    ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", Meaning::Runtime),
    ("HOROVOD_TIMELINE", Meaning::Runtime),
    ("HOROVOD_TIMELINE_MARK_CYCLES", Meaning::Runtime),
    ("HOROVOD_STALL_CHECK_DISABLE", Meaning::Runtime),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", Meaning::Runtime),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", Meaning::Runtime),
    ("HOROVOD_GLOO_TIMEOUT_SECONDS", Meaning::Runtime),
    ("HOROVOD_THREAD_AFFINITY", Meaning::Runtime),
    ("HOROVOD_NUM_NCCL_STREAMS", Meaning::Runtime),
    ("HOROVOD_LOG_LEVEL", Meaning::Runtime),
    ("HOROVOD_LOG_HIDE_TIME", Meaning::Runtime),
    // Process sets can be added and removed at any time in hvd: dynamic is the only mode.
    ("HOROVOD_DYNAMIC_PROCESS_SETS", Meaning::Runtime),
    // Horovod's CPU operations and controller: `gloo` is hvd's own transport; others are refused.
    ("HOROVOD_CPU_OPERATIONS", Meaning::Runtime),
    ("HOROVOD_CONTROLLER", Meaning::Runtime),
    (
        "HOROVOD_TORUS_ALLREDUCE",
        Meaning::Ignored(
            "torus allreduce runs its cross-host step on NCCL, which this build lacks; \
             HOROVOD_HIERARCHICAL_ALLREDUCE=1 has the same shape over hvd's transport",
        ),
    ),
    (
        "HOROVOD_MPI_THREADS_DISABLE",
        Meaning::Ignored("hvd does not use MPI, so there are no MPI threads to disable"),
    ),
    (
        "HOROVOD_SPARK_START_TIMEOUT",
        Meaning::Ignored("hvd has no Spark integration; horovodrun's --start-timeout applies"),
    ),
    (
        "HOROVOD_CCL_BGT_AFFINITY",
        Meaning::Ignored("hvd has no oneCCL operations; --thread-affinity pins the engine thread"),
    ),
    (
        "HOROVOD_CCL_CACHE",
        Meaning::Ignored("hvd has no oneCCL operations"),
    ),
    (
        "HOROVOD_ENABLE_XLA_OPS",
        Meaning::Ignored("hvd has no TensorFlow integration (XLA ops are TensorFlow's)"),
    ),
    (
        "HOROVOD_GPU_OPERATIONS",
        Meaning::BuildIgnored(
            "hvd's build has no NCCL or DDL: CUDA tensors are reduced through host memory",
        ),
    ),
    (
        "HOROVOD_GPU_ALLREDUCE",
        Meaning::BuildIgnored(
            "hvd's build has no NCCL or DDL: CUDA tensors are reduced through host memory",
        ),
    ),
    (
        "HOROVOD_GPU_ALLGATHER",
        Meaning::BuildIgnored(
            "hvd's build has no NCCL: CUDA tensors are gathered through host memory",
        ),
    ),
    (
        "HOROVOD_GPU_BROADCAST",
        Meaning::BuildIgnored(
            "hvd's build has no NCCL: CUDA tensors are broadcast through host memory",
        ),
    ),
    (
        "HOROVOD_GPU",
        Meaning::BuildIgnored("hvd's build compiles no CUDA or ROCm kernels"),
    ),
    (
        "HOROVOD_ALLOW_MIXED_GPU_IMPL",
        Meaning::BuildIgnored("hvd's build has no GPU operations to mix"),
    ),
    (
        "HOROVOD_MIXED_INSTALL",
        Meaning::BuildIgnored("hvd's build has no framework extensions to mix"),
    ),
    (
        "HOROVOD_CUDA_HOME",
        Meaning::BuildIgnored("hvd's build does not link CUDA"),
    ),
    (
        "HOROVOD_ROCM_HOME",
        Meaning::BuildIgnored("hvd's build does not link ROCm"),
    ),
    (
        "HOROVOD_NCCL_HOME",
        Meaning::BuildIgnored("hvd's build does not link NCCL"),
    ),
    (
        "HOROVOD_NCCL_INCLUDE",
        Meaning::BuildIgnored("hvd's build does not link NCCL"),
    ),
    (
        "HOROVOD_NCCL_LIB",
        Meaning::BuildIgnored("hvd's build does not link NCCL"),
    ),
    (
        "HOROVOD_NCCL_LINK",
        Meaning::BuildIgnored("hvd's build does not link NCCL"),
    ),
    (
        "HOROVOD_BUILD_CUDA_CC_LIST",
        Meaning::BuildIgnored("hvd's build compiles no CUDA kernels"),
    ),
    (
        "HOROVOD_BUILD_ARCH_FLAGS",
        Meaning::BuildIgnored("hvd's native module is built by cargo; set RUSTFLAGS instead"),
    ),
    (
        "HOROVOD_CMAKE",
        Meaning::BuildIgnored("hvd's native module is built by cargo, not CMake"),
    ),
    (
        "HOROVOD_DEBUG",
        Meaning::BuildIgnored(
            "hvd's native module is built by maturin; pass --profile dev for a debug build",
        ),
    ),
];

/// The frameworks and libraries hvd's build can include, by the suffix of Horovod's
/// `HOROVOD_WITH_*` / `HOROVOD_WITHOUT_*` switches.
const BUILT: &[&str] = &["PYTORCH", "GLOO"];

/// What hvd makes of a build switch `HOROVOD_WITH_<PART>` or `HOROVOD_WITHOUT_<PART>` set to
/// `value`: `Ok` where hvd's build satisfies it, `Err` with the reason where it cannot (a
/// part hvd's build lacks was asked for). `None` for other names.
pub fn build_switch(name: &str, value: &str) -> Option<Result<(), String>> {
    let on = !matches!(value.trim(), "" | "0");
    if let Some(part) = name.strip_prefix("HOROVOD_WITHOUT_") {
        return Some(if on && part == "GLOO" {
            Err(format!(
                "{name}={value}: Gloo-style TCP is hvd's only transport and cannot be left out"
            ))
        } else {
            Ok(())
        });
    }
    let part = name.strip_prefix("HOROVOD_WITH_")?;
    Some(if !on || BUILT.contains(&part) {
        Ok(())
    } else {
        Err(format!(
            "{name}={value}: hvd's build has no {} support (it has PyTorch over Gloo-style TCP)",
            part.to_lowercase()
        ))
    })
}

/// The meaning of `name`, if it is one of Horovod's variables.
pub fn horovod_var(name: &str) -> Option<Meaning> {
    if name.starts_with("HOROVOD_WITH_") || name.starts_with("HOROVOD_WITHOUT_") {
        return Some(Meaning::Build);
    }
    HOROVOD_VARS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, m)| *m)
}

/// Checks a run-time setting of Horovod's that selects a part by value
/// (`HOROVOD_CPU_OPERATIONS`, `HOROVOD_CONTROLLER`): `gloo` is hvd's transport; MPI, oneCCL
/// and the rest are refused with the reason.
///
/// # Errors
/// The variable, its value and why hvd cannot honour it.
pub fn check_backend(name: &str, value: &str) -> Result<(), String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "" | "gloo" => Ok(()),
        "mpi" => Err(format!(
            "{name}={value}: hvd does not use MPI; its collectives run over its own Gloo-style \
             TCP transport (unset {name} or set it to gloo)"
        )),
        "ccl" => Err(format!(
            "{name}={value}: hvd has no oneCCL operations; its collectives run over its own \
             Gloo-style TCP transport (unset {name} or set it to gloo)"
        )),
        other => Err(format!(
            "{name}={other}: not a backend hvd knows (gloo is its transport)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_asking_for_missing_parts_are_refused() {
        assert_eq!(build_switch("HOROVOD_WITH_PYTORCH", "1"), Some(Ok(())));
        assert_eq!(build_switch("HOROVOD_WITH_GLOO", "1"), Some(Ok(())));
        assert_eq!(build_switch("HOROVOD_WITHOUT_MXNET", "1"), Some(Ok(())));
        assert_eq!(build_switch("HOROVOD_WITH_MPI", "0"), Some(Ok(())));
        let e = build_switch("HOROVOD_WITH_TENSORFLOW", "1")
            .unwrap()
            .unwrap_err();
        assert!(
            e.contains("HOROVOD_WITH_TENSORFLOW=1") && e.contains("tensorflow"),
            "{e}"
        );
        assert!(build_switch("HOROVOD_WITH_MPI", "1").unwrap().is_err());
        assert!(build_switch("HOROVOD_WITHOUT_GLOO", "1").unwrap().is_err());
        assert_eq!(build_switch("HOROVOD_CYCLE_TIME", "1"), None);
    }

    /// Every `HOROVOD_*` variable Horovod's documentation (shared/seeds) names.
    const DOCUMENTED: &[&str] = &[
        "HOROVOD_ALLOW_MIXED_GPU_IMPL",
        "HOROVOD_AUTOTUNE",
        "HOROVOD_AUTOTUNE_LOG",
        "HOROVOD_BUILD_ARCH_FLAGS",
        "HOROVOD_BUILD_CUDA_CC_LIST",
        "HOROVOD_CCL_BGT_AFFINITY",
        "HOROVOD_CCL_CACHE",
        "HOROVOD_CMAKE",
        "HOROVOD_CPU_OPERATIONS",
        "HOROVOD_CUDA_HOME",
        "HOROVOD_CYCLE_TIME",
        "HOROVOD_DEBUG",
        "HOROVOD_DYNAMIC_PROCESS_SETS",
        "HOROVOD_ELASTIC_TIMEOUT",
        "HOROVOD_ENABLE_XLA_OPS",
        "HOROVOD_FUSION_THRESHOLD",
        "HOROVOD_GLOO_TIMEOUT_SECONDS",
        "HOROVOD_GPU",
        "HOROVOD_GPU_ALLGATHER",
        "HOROVOD_GPU_ALLREDUCE",
        "HOROVOD_GPU_BROADCAST",
        "HOROVOD_GPU_OPERATIONS",
        "HOROVOD_HIERARCHICAL_ALLREDUCE",
        "HOROVOD_LOG_LEVEL",
        "HOROVOD_MIXED_INSTALL",
        "HOROVOD_MPI_THREADS_DISABLE",
        "HOROVOD_NCCL_HOME",
        "HOROVOD_NCCL_INCLUDE",
        "HOROVOD_NCCL_LIB",
        "HOROVOD_NCCL_LINK",
        "HOROVOD_ROCM_HOME",
        "HOROVOD_SPARK_START_TIMEOUT",
        "HOROVOD_START_TIMEOUT",
        "HOROVOD_THREAD_AFFINITY",
        "HOROVOD_TIMELINE",
        "HOROVOD_TIMELINE_MARK_CYCLES",
        "HOROVOD_WITHOUT_GLOO",
        "HOROVOD_WITHOUT_MPI",
        "HOROVOD_WITHOUT_MXNET",
        "HOROVOD_WITHOUT_PYTORCH",
        "HOROVOD_WITHOUT_TENSORFLOW",
        "HOROVOD_WITH_GLOO",
        "HOROVOD_WITH_MPI",
        "HOROVOD_WITH_MXNET",
        "HOROVOD_WITH_PYTORCH",
        "HOROVOD_WITH_TENSORFLOW",
    ];

    #[test]
    fn every_documented_variable_has_a_meaning() {
        for v in DOCUMENTED {
            assert!(horovod_var(v).is_some(), "{v} is not judged");
        }
    }

    #[test]
    fn every_variable_is_judged_once() {
        for (i, (n, _)) in HOROVOD_VARS.iter().enumerate() {
            assert!(n.starts_with("HOROVOD_"), "{n}");
            assert!(!HOROVOD_VARS[..i].iter().any(|(m, _)| m == n), "{n} twice");
        }
        assert_eq!(horovod_var("HOROVOD_CYCLE_TIME"), Some(Meaning::Runtime));
        assert_eq!(horovod_var("HOROVOD_WITHOUT_MPI"), Some(Meaning::Build));
        assert_eq!(horovod_var("HOROVOD_NO_SUCH"), None);
    }

    #[test]
    fn backends_other_than_gloo_are_refused_by_name() {
        assert!(check_backend("HOROVOD_CPU_OPERATIONS", "gloo").is_ok());
        assert!(check_backend("HOROVOD_CONTROLLER", "GLOO").is_ok());
        let e = check_backend("HOROVOD_CPU_OPERATIONS", "MPI").unwrap_err();
        assert!(
            e.starts_with("HOROVOD_CPU_OPERATIONS=MPI") && e.contains("MPI"),
            "{e}"
        );
        assert!(check_backend("HOROVOD_CPU_OPERATIONS", "ccl").is_err());
        assert!(check_backend("HOROVOD_CONTROLLER", "tcp").is_err());
    }
}
