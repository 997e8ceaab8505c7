//! Horovod's `horovodrun` surface beyond the launch itself: its YAML `--config-file`,
//! `--check-build`, the variables its tuning, autotune, stall-check, library and logging flags
//! become for the workers, and the check of the `HOROVOD_*` variables `horovodrun` is started
//! with.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use hvd_rendezvous::Meaning;
use serde::Deserialize;

use crate::cli::{Args, LogLevel};

/// Horovod's runtime configuration file (`--config-file`), section by section.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    controller: Option<String>,
    params: Option<Params>,
    autotune: Option<Autotune>,
    timeline: Option<Timeline>,
    stall_check: Option<StallCheck>,
    library_options: Option<LibraryOptions>,
    logging: Option<Logging>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Params {
    fusion_threshold_mb: Option<f64>,
    cycle_time_ms: Option<f64>,
    cache_capacity: Option<u64>,
    hierarchical_allreduce: Option<bool>,
    hierarchical_allgather: Option<bool>,
    torus_allreduce: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Autotune {
    enabled: Option<bool>,
    log_file: Option<PathBuf>,
    warmup_samples: Option<u32>,
    steps_per_sample: Option<u32>,
    bayes_opt_max_samples: Option<u32>,
    gaussian_process_noise: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Timeline {
    filename: Option<PathBuf>,
    mark_cycles: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StallCheck {
    enabled: Option<bool>,
    warning_time_seconds: Option<u64>,
    shutdown_time_seconds: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LibraryOptions {
    mpi_threads_disable: Option<bool>,
    num_nccl_streams: Option<u32>,
    thread_affinity: Option<ThreadAffinity>,
    gloo_timeout_seconds: Option<u64>,
}

/// `library_options.thread_affinity`: a core (Horovod's type) or a list, `0,1,2,3`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ThreadAffinity {
    One(u32),
    List(String),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Logging {
    level: Option<String>,
    with_timestamp: Option<bool>,
    /// Horovod's older spelling, the inverse of `with_timestamp`.
    hide_timestamp: Option<bool>,
}

/// Sets `slot` from the file where the command line left it unset.
fn fill<T>(slot: &mut Option<T>, from_file: Option<T>) {
    if slot.is_none() {
        *slot = from_file;
    }
}

/// Sets a pair of opposite switches from the file where neither was given.
fn fill_switch(on: &mut bool, off: &mut bool, from_file: Option<bool>) {
    if let (false, false, Some(v)) = (*on, *off, from_file) {
        *on = v;
        *off = !v;
    }
}

/// Reads `--config-file` into `args`, the command line's values winning over the file's.
///
/// # Errors
/// An unreadable file, YAML that is not Horovod's configuration (an unknown key is named), or
/// a value hvd cannot honour (the MPI controller).
pub fn apply_config_file(args: &mut Args) -> anyhow::Result<()> {
    let Some(path) = args.config_file.clone() else {
        return Ok(());
    };
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("--config-file {}", path.display()))?;
    apply_config(args, &path, &text)
}

/// [`apply_config_file`] with the file's text passed in.
fn apply_config(args: &mut Args, path: &Path, text: &str) -> anyhow::Result<()> {
    let cfg: ConfigFile = if text.trim().is_empty() {
        ConfigFile::default()
    } else {
        serde_norway::from_str(text).with_context(|| {
            format!(
                "--config-file {}: not Horovod's configuration",
                path.display()
            )
        })?
    };
    if let Some(c) = &cfg.controller {
        match c.trim().to_ascii_lowercase().as_str() {
            "gloo" => args.gloo |= !args.mpi && !args.jsrun,
            "mpi" if !args.gloo => bail!(
                "--config-file {}: controller: {c}: hvd does not use MPI; its collectives run \
                 over its own Gloo-style TCP transport (controller: gloo)",
                path.display()
            ),
            "mpi" => {}
            other => bail!(
                "--config-file {}: controller: {other}: no such controller (hvd's is gloo)",
                path.display()
            ),
        }
    }
    if let Some(p) = cfg.params {
        fill(&mut args.fusion_threshold_mb, p.fusion_threshold_mb);
        fill(&mut args.cycle_time_ms, p.cycle_time_ms);
        fill(&mut args.cache_capacity, p.cache_capacity);
        fill_switch(
            &mut args.hierarchical_allreduce,
            &mut args.no_hierarchical_allreduce,
            p.hierarchical_allreduce,
        );
        fill_switch(
            &mut args.hierarchical_allgather,
            &mut args.no_hierarchical_allgather,
            p.hierarchical_allgather,
        );
        fill_switch(
            &mut args.torus_allreduce,
            &mut args.no_torus_allreduce,
            p.torus_allreduce,
        );
    }
    if let Some(a) = cfg.autotune {
        fill_switch(&mut args.autotune, &mut args.no_autotune, a.enabled);
        fill(&mut args.autotune_log_file, a.log_file);
        fill(&mut args.autotune_warmup_samples, a.warmup_samples);
        fill(&mut args.autotune_steps_per_sample, a.steps_per_sample);
        fill(
            &mut args.autotune_bayes_opt_max_samples,
            a.bayes_opt_max_samples,
        );
        fill(
            &mut args.autotune_gaussian_process_noise,
            a.gaussian_process_noise,
        );
    }
    if let Some(t) = cfg.timeline {
        fill(&mut args.timeline, t.filename);
        fill_switch(
            &mut args.timeline_mark_cycles,
            &mut args.no_timeline_mark_cycles,
            t.mark_cycles,
        );
    }
    if let Some(s) = cfg.stall_check {
        fill_switch(&mut args.stall_check, &mut args.no_stall_check, s.enabled);
        fill(
            &mut args.stall_check_warning_time_seconds,
            s.warning_time_seconds,
        );
        fill(
            &mut args.stall_check_shutdown_time_seconds,
            s.shutdown_time_seconds,
        );
    }
    if let Some(l) = cfg.library_options {
        fill_switch(
            &mut args.mpi_threads_disable,
            &mut args.no_mpi_threads_disable,
            l.mpi_threads_disable,
        );
        fill(&mut args.num_nccl_streams, l.num_nccl_streams);
        fill(
            &mut args.thread_affinity,
            l.thread_affinity.map(|a| match a {
                ThreadAffinity::One(c) => c.to_string(),
                ThreadAffinity::List(l) => l,
            }),
        );
        fill(&mut args.gloo_timeout_seconds, l.gloo_timeout_seconds);
    }
    if let Some(l) = cfg.logging {
        if args.log_level.is_none()
            && let Some(level) = l.level
        {
            args.log_level = Some(
                <LogLevel as clap::ValueEnum>::from_str(level.trim(), true).map_err(|_| {
                    anyhow::anyhow!(
                        "--config-file {}: logging: level: {level}: not one of TRACE, \
                             DEBUG, INFO, WARNING, ERROR, FATAL",
                        path.display()
                    )
                })?,
            );
        }
        let with = l.with_timestamp.or(l.hide_timestamp.map(|h| !h));
        fill_switch(
            &mut args.log_with_timestamp,
            &mut args.log_without_timestamp,
            with,
        );
    }
    Ok(())
}

/// The variables Horovod's tuning, autotune, stall-check, library and logging flags become
/// for the workers (Horovod's names). Values are checked here, before anything starts.
///
/// # Errors
/// A value out of range, named with its flag.
pub fn knob_env(args: &Args) -> anyhow::Result<Vec<(String, String)>> {
    use hvd_rendezvous as rv;
    let mut env: Vec<(String, String)> = Vec::new();
    let mut set = |k: &str, v: String| env.push((k.to_string(), v));
    let flag = |b: bool| if b { "1" } else { "0" }.to_string();
    if args.hierarchical_allgather || args.no_hierarchical_allgather {
        set(
            rv::ENV_HIERARCHICAL_ALLGATHER,
            flag(args.hierarchical_allgather),
        );
    }
    if args.autotune {
        set(rv::ENV_AUTOTUNE, "1".into());
        if let Some(p) = &args.autotune_log_file {
            let abs = std::path::absolute(p)
                .with_context(|| format!("--autotune-log-file {}", p.display()))?;
            // Emptied once here: rank 0 of each elastic round appends its samples.
            std::fs::write(&abs, "")
                .with_context(|| format!("--autotune-log-file {}", p.display()))?;
            set(rv::ENV_AUTOTUNE_LOG, abs.display().to_string());
        }
        for (name, var, v) in [
            (
                "--autotune-warmup-samples",
                rv::ENV_AUTOTUNE_WARMUP_SAMPLES,
                args.autotune_warmup_samples,
            ),
            (
                "--autotune-steps-per-sample",
                rv::ENV_AUTOTUNE_STEPS_PER_SAMPLE,
                args.autotune_steps_per_sample,
            ),
            (
                "--autotune-bayes-opt-max-samples",
                rv::ENV_AUTOTUNE_BAYES_OPT_MAX_SAMPLES,
                args.autotune_bayes_opt_max_samples,
            ),
        ] {
            match v {
                Some(0) if name != "--autotune-warmup-samples" => {
                    bail!("{name} must be at least 1")
                }
                Some(n) => set(var, n.to_string()),
                None => {}
            }
        }
        if let Some(x) = args.autotune_gaussian_process_noise {
            if !(0.0..=1.0).contains(&x) {
                bail!("--autotune-gaussian-process-noise must be from 0 to 1, not {x}");
            }
            set(rv::ENV_AUTOTUNE_GAUSSIAN_PROCESS_NOISE, x.to_string());
        }
    } else {
        let tuned = [
            ("--autotune-log-file", args.autotune_log_file.is_some()),
            (
                "--autotune-warmup-samples",
                args.autotune_warmup_samples.is_some(),
            ),
            (
                "--autotune-steps-per-sample",
                args.autotune_steps_per_sample.is_some(),
            ),
            (
                "--autotune-bayes-opt-max-samples",
                args.autotune_bayes_opt_max_samples.is_some(),
            ),
            (
                "--autotune-gaussian-process-noise",
                args.autotune_gaussian_process_noise.is_some(),
            ),
        ];
        if let Some((name, _)) = tuned.iter().find(|(_, given)| *given) {
            tracing::warn!("{name} has no effect without --autotune");
        }
    }
    if args.no_stall_check {
        set(rv::ENV_STALL_CHECK_DISABLE, "1".into());
    }
    if let Some(w) = args.stall_check_warning_time_seconds {
        set(rv::ENV_STALL_CHECK_TIME, w.to_string());
    }
    if let Some(s) = args.stall_check_shutdown_time_seconds {
        let warning = args.stall_check_warning_time_seconds.unwrap_or_else(|| {
            std::env::var(rv::ENV_STALL_CHECK_TIME)
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(60)
        });
        if s > 0 && s < warning {
            tracing::warn!(
                "--stall-check-shutdown-time-seconds {s} is below the warning time \
                 ({warning} s): stalled ops are only warned about, as with Horovod"
            );
        }
        set(rv::ENV_STALL_SHUTDOWN_TIME, s.to_string());
    }
    if let Some(n) = args.num_nccl_streams {
        if n == 0 {
            bail!("--num-nccl-streams must be at least 1");
        }
        tracing::info!("--num-nccl-streams {n}: this build has no NCCL, so it has no effect");
        set(rv::ENV_NUM_NCCL_STREAMS, n.to_string());
    }
    if let Some(c) = &args.thread_affinity {
        let cores: Result<Vec<u32>, _> = c.split(',').map(|k| k.trim().parse::<u32>()).collect();
        match cores {
            Ok(list) if !list.is_empty() => set(
                rv::ENV_THREAD_AFFINITY,
                list.iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
            ),
            _ => bail!(
                "--thread-affinity takes core numbers, one per rank of a host (0,1,2,3), not '{c}'"
            ),
        }
    }
    if let Some(t) = args.gloo_timeout_seconds {
        if t == 0 {
            bail!("--gloo-timeout-seconds must be at least 1");
        }
        set(rv::ENV_GLOO_TIMEOUT_SECONDS, t.to_string());
    }
    if let Some(l) = args.log_level {
        set(rv::ENV_LOG_LEVEL, l.name().into());
    }
    if args.log_without_timestamp || args.log_with_timestamp || args.no_log_hide_timestamp {
        set(rv::ENV_LOG_HIDE_TIME, flag(args.log_without_timestamp));
    }
    if args.tcp {
        set("NCCL_IB_DISABLE", "1".into());
    }
    if args.mpi_threads_disable {
        tracing::info!("--mpi-threads-disable: hvd does not use MPI, so it has no effect");
    }
    Ok(env)
}

/// Horovod's run-time variables of `horovodrun`'s own environment that every worker gets,
/// remote ones too (as Horovod forwards them): those hvd reads, except the ones each worker is
/// given for itself (`HOROVOD_RANK`…) or as horovodrun resolved it (the timeouts), and those
/// already in `set` (a flag's value wins).
pub fn forwarded_env(
    vars: impl IntoIterator<Item = (String, String)>,
    set: &[(String, String)],
) -> Vec<(String, String)> {
    const PER_WORKER: &[&str] = &[
        "HOROVOD_RANK",
        "HOROVOD_SIZE",
        "HOROVOD_LOCAL_RANK",
        "HOROVOD_LOCAL_SIZE",
        "HOROVOD_CROSS_RANK",
        "HOROVOD_CROSS_SIZE",
        "HOROVOD_HOSTNAME",
        "HOROVOD_ELASTIC",
        // Resolved by horovodrun (flag, else variable) and given to each worker as resolved.
        "HOROVOD_START_TIMEOUT",
        "HOROVOD_ELASTIC_TIMEOUT",
    ];
    let mut out: Vec<(String, String)> = vars
        .into_iter()
        .filter(|(k, _)| hvd_rendezvous::horovod_var(k) == Some(Meaning::Runtime))
        .filter(|(k, _)| !PER_WORKER.contains(&k.as_str()))
        .filter(|(k, _)| !set.iter().any(|(s, _)| s == k))
        .collect();
    out.sort();
    out
}

/// Checks the `HOROVOD_*` variables `horovodrun` runs with: a backend hvd lacks is refused;
/// variables without meaning here are returned as warnings that name them and say why.
///
/// # Errors
/// `HOROVOD_CPU_OPERATIONS` or `HOROVOD_CONTROLLER` naming MPI, oneCCL or an unknown backend.
pub fn check_environment(
    vars: impl IntoIterator<Item = (String, String)>,
) -> anyhow::Result<Vec<String>> {
    let mut warnings = Vec::new();
    for (name, value) in vars {
        if !name.starts_with("HOROVOD_") {
            continue;
        }
        match hvd_rendezvous::horovod_var(&name) {
            Some(Meaning::Runtime) => {
                if name == "HOROVOD_CPU_OPERATIONS" || name == "HOROVOD_CONTROLLER" {
                    hvd_rendezvous::check_backend(&name, &value).map_err(anyhow::Error::msg)?;
                }
            }
            Some(Meaning::Build) => {
                if let Some(Err(why)) = hvd_rendezvous::build_switch(&name, &value) {
                    warnings.push(format!(
                        "{why} (a build setting; it has no effect on a run)"
                    ));
                }
            }
            Some(Meaning::BuildIgnored(why)) => {
                warnings.push(format!(
                    "{name} is a build setting of Horovod's; it has no effect here: {why}"
                ));
            }
            Some(Meaning::Ignored(why)) => {
                warnings.push(format!("{name} has no effect: {why}"));
            }
            None => warnings.push(format!(
                "{name} is not a variable hvd reads; the workers get it unchanged"
            )),
        }
    }
    Ok(warnings)
}

/// The shell command that runs `--host-discovery-script SCRIPT`: a bare file name that is
/// not a command on `PATH` but a file in the working directory (as Horovod's documentation
/// writes `--host-discovery-script discover_hosts.sh`) runs that file.
pub fn discovery_command(script: &str, path: Option<&std::ffi::OsStr>) -> String {
    let bare = !script.is_empty()
        && !script.contains('/')
        && !script
            .chars()
            .any(|c| c.is_whitespace() || "'\"$`;&|<>()".contains(c));
    let on_path = || {
        path.map(std::env::split_paths)
            .into_iter()
            .flatten()
            .any(|d| d.join(script).is_file())
    };
    if bare && Path::new(script).is_file() && !on_path() {
        tracing::info!("discovery script {script} is run from the working directory (./{script})");
        format!("./{script}")
    } else {
        script.to_string()
    }
}

/// What `--check-build` prints: Horovod's layout, with what this build has checked.
/// `torch` tells whether the `hvd` Python package and PyTorch import in this machine's
/// `python3`.
pub fn check_build_report(torch: bool) -> String {
    let x = |b: bool| if b { 'X' } else { ' ' };
    format!(
        "hvd v{version} (horovodrun, Horovod 0.28's command line):\n\n\
         Available Frameworks:\n    \
         [ ] TensorFlow\n    \
         [{torch}] PyTorch\n    \
         [ ] MXNet\n    \
         [X] Rust (the hvd crate)\n\n\
         Available Controllers:\n    \
         [ ] MPI\n    \
         [X] Gloo\n\n\
         Available Tensor Operations:\n    \
         [ ] NCCL\n    \
         [ ] DDL\n    \
         [ ] CCL\n    \
         [ ] MPI\n    \
         [X] Gloo\n",
        version = env!("CARGO_PKG_VERSION"),
        torch = x(torch),
    )
}

/// Whether `python3` imports the `hvd` package's native module and PyTorch; the reason when
/// not, for `--verbose`.
pub fn torch_available() -> Result<(), String> {
    let out = std::process::Command::new("python3")
        .args(["-c", "import hvd._hvd, torch"])
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run python3: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        Err(err.lines().last().unwrap_or("import failed").to_string())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use clap::Parser;

    use super::*;

    fn parse(args: &[&str]) -> Args {
        let argv = std::iter::once("horovodrun")
            .chain(args.iter().copied())
            .map(String::from);
        Args::try_parse_from(crate::cli::normalize(argv)).unwrap()
    }

    /// Horovod's own test configuration.
    const HOROVOD_CONFIG: &str = "controller: gloo

params:
  fusion_threshold_mb: 32
  cycle_time_ms: 10
  cache_capacity: 2048
  hierarchical_allreduce: true
  hierarchical_allgather: true

autotune:
  enabled: true
  log_file: 'horovod_autotune_log.txt'
  warmup_samples: 5
  steps_per_sample: 20
  bayes_opt_max_samples: 50
  gaussian_process_noise: 0.9

timeline:
  filename: 'horovod_timeline.json'
  mark_cycles: true

stall_check:
  enabled: true
  warning_time_seconds: 120
  shutdown_time_seconds: 240

library_options:
  mpi_threads_disable: true
  num_nccl_streams: 2
  thread_affinity: 1
  gloo_timeout_seconds: 60

logging:
  level: INFO
  hide_timestamp: true
";

    #[test]
    fn horovods_config_file_is_read_and_flags_win() {
        let mut a = parse(&[
            "-np",
            "2",
            "--cycle-time-ms",
            "3.5",
            "--no-hierarchical-allgather",
            "--log-level",
            "debug",
            "x",
        ]);
        apply_config(&mut a, Path::new("c.yaml"), HOROVOD_CONFIG).unwrap();
        assert!(a.gloo);
        assert_eq!(a.fusion_threshold_mb, Some(32.0));
        assert_eq!(a.cycle_time_ms, Some(3.5), "the flag wins");
        assert_eq!(a.cache_capacity, Some(2048));
        assert!(a.hierarchical_allreduce && !a.no_hierarchical_allreduce);
        assert!(
            !a.hierarchical_allgather && a.no_hierarchical_allgather,
            "the flag wins"
        );
        assert!(a.autotune);
        assert_eq!(
            a.autotune_log_file.as_deref(),
            Some(Path::new("horovod_autotune_log.txt"))
        );
        assert_eq!(
            (
                a.autotune_warmup_samples,
                a.autotune_steps_per_sample,
                a.autotune_bayes_opt_max_samples,
                a.autotune_gaussian_process_noise
            ),
            (Some(5), Some(20), Some(50), Some(0.9))
        );
        assert_eq!(
            a.timeline.as_deref(),
            Some(Path::new("horovod_timeline.json"))
        );
        assert!(a.timeline_mark_cycles);
        assert!(!a.no_stall_check);
        assert_eq!(
            (
                a.stall_check_warning_time_seconds,
                a.stall_check_shutdown_time_seconds
            ),
            (Some(120), Some(240))
        );
        assert!(a.mpi_threads_disable);
        assert_eq!(
            (
                a.num_nccl_streams,
                a.thread_affinity.as_deref(),
                a.gloo_timeout_seconds
            ),
            (Some(2), Some("1"), Some(60))
        );
        assert_eq!(a.log_level, Some(LogLevel::Debug), "the flag wins");
        assert!(a.log_without_timestamp);

        // The file is emptied when the job is planned: keep it out of the source tree.
        let log = std::env::temp_dir().join(format!("hvd-autotune-{}.csv", std::process::id()));
        a.autotune_log_file = Some(log.clone());
        let env = knob_env(&a).unwrap();
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "");
        std::fs::remove_file(&log).unwrap();
        let get = |k: &str| {
            env.iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
                .unwrap_or_else(|| panic!("{k} not set in {env:?}"))
        };
        assert_eq!(get("HOROVOD_HIERARCHICAL_ALLGATHER"), "0");
        assert_eq!(get("HOROVOD_AUTOTUNE"), "1");
        assert_eq!(get("HOROVOD_AUTOTUNE_LOG"), log.display().to_string());
        assert_eq!(get("HOROVOD_AUTOTUNE_WARMUP_SAMPLES"), "5");
        assert_eq!(get("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"), "20");
        assert_eq!(get("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES"), "50");
        assert_eq!(get("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"), "0.9");
        assert_eq!(get("HOROVOD_STALL_CHECK_TIME_SECONDS"), "120");
        assert_eq!(get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"), "240");
        assert_eq!(get("HOROVOD_NUM_NCCL_STREAMS"), "2");
        assert_eq!(get("HOROVOD_THREAD_AFFINITY"), "1");
        assert_eq!(get("HOROVOD_GLOO_TIMEOUT_SECONDS"), "60");
        assert_eq!(get("HOROVOD_LOG_LEVEL"), "DEBUG");
        assert_eq!(get("HOROVOD_LOG_HIDE_TIME"), "1");
        assert!(!env.iter().any(|(k, _)| k == "HOROVOD_STALL_CHECK_DISABLE"));
    }

    #[test]
    fn bad_config_files_are_named() {
        let mut a = parse(&["x"]);
        let e = format!(
            "{:#}",
            apply_config(&mut a, Path::new("c.yaml"), "params:\n  fusion_mb: 3\n").unwrap_err()
        );
        assert!(e.contains("c.yaml") && e.contains("fusion_mb"), "{e}");
        let e = format!(
            "{:#}",
            apply_config(&mut a, Path::new("c.yaml"), "controller: mpi\n").unwrap_err()
        );
        assert!(e.contains("controller: mpi") && e.contains("MPI"), "{e}");
        let e = format!(
            "{:#}",
            apply_config(&mut a, Path::new("c.yaml"), "logging:\n  level: LOUD\n").unwrap_err()
        );
        assert!(e.contains("LOUD"), "{e}");
        let e = format!(
            "{:#}",
            apply_config(&mut a, Path::new("c.yaml"), "params: [1, 2]\n").unwrap_err()
        );
        assert!(e.contains("c.yaml"), "{e}");
        apply_config(&mut a, Path::new("c.yaml"), "").unwrap();
    }

    #[test]
    fn knob_values_are_checked() {
        let err = |args: &[&str]| format!("{:#}", knob_env(&parse(args)).unwrap_err());
        assert!(
            err(&[
                "--autotune",
                "--autotune-gaussian-process-noise",
                "1.5",
                "x"
            ])
            .contains("--autotune-gaussian-process-noise")
        );
        assert!(
            err(&["--autotune", "--autotune-steps-per-sample", "0", "x"])
                .contains("--autotune-steps-per-sample")
        );
        assert!(err(&["--gloo-timeout-seconds", "0", "x"]).contains("--gloo-timeout-seconds"));
        assert!(err(&["--thread-affinity", "0,one", "x"]).contains("--thread-affinity"));
        let env = knob_env(&parse(&["--thread-affinity", "0, 2,4", "x"])).unwrap();
        assert_eq!(
            env,
            [("HOROVOD_THREAD_AFFINITY".to_string(), "0,2,4".to_string())]
        );
        assert!(err(&["--num-nccl-streams", "0", "x"]).contains("--num-nccl-streams"));
        // Without --autotune its settings set nothing, as with Horovod.
        let env = knob_env(&parse(&["--autotune-warmup-samples", "2", "x"])).unwrap();
        assert!(env.is_empty(), "{env:?}");
        let env = knob_env(&parse(&["--no-stall-check", "--tcp", "x"])).unwrap();
        assert_eq!(
            env,
            [
                ("HOROVOD_STALL_CHECK_DISABLE".to_string(), "1".to_string()),
                ("NCCL_IB_DISABLE".to_string(), "1".to_string())
            ]
        );
    }

    #[test]
    fn horovods_variables_reach_remote_workers_and_flags_win() {
        let own = [
            ("HOROVOD_CYCLE_TIME", "5"),
            ("HOROVOD_FUSION_THRESHOLD", "1024"),
            ("HOROVOD_RANK", "3"),
            ("HOROVOD_START_TIMEOUT", "9"),
            ("HOROVOD_NCCL_HOME", "/x"),
            ("HOME", "/root"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let set = [("HOROVOD_CYCLE_TIME".to_string(), "2".to_string())];
        assert_eq!(
            forwarded_env(own, &set),
            [("HOROVOD_FUSION_THRESHOLD".to_string(), "1024".to_string())]
        );
    }

    #[test]
    fn the_environment_is_checked() {
        let vars = |v: &[(&str, &str)]| {
            v.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<Vec<_>>()
        };
        let w = check_environment(vars(&[
            ("PATH", "/bin"),
            ("HOROVOD_CYCLE_TIME", "5"),
            ("HOROVOD_CPU_OPERATIONS", "gloo"),
            ("HOROVOD_WITH_PYTORCH", "1"),
            ("HOROVOD_WITH_TENSORFLOW", "1"),
            ("HOROVOD_NCCL_HOME", "/usr/local/nccl"),
            ("HOROVOD_MPI_THREADS_DISABLE", "1"),
            ("HOROVOD_MADE_UP", "1"),
        ]))
        .unwrap();
        assert_eq!(w.len(), 4, "{w:?}");
        assert!(w[0].contains("HOROVOD_WITH_TENSORFLOW"), "{w:?}");
        assert!(
            w[1].contains("HOROVOD_NCCL_HOME") && w[1].contains("NCCL"),
            "{w:?}"
        );
        assert!(w[2].contains("HOROVOD_MPI_THREADS_DISABLE") && w[2].contains("MPI"));
        assert!(w[3].contains("HOROVOD_MADE_UP"));
        let e = check_environment(vars(&[("HOROVOD_CPU_OPERATIONS", "mpi")])).unwrap_err();
        assert!(e.to_string().contains("HOROVOD_CPU_OPERATIONS=mpi"), "{e}");
    }

    #[test]
    fn a_bare_discovery_script_in_the_working_directory_is_found() {
        let dir = std::env::temp_dir().join(format!("hvd-disc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let name = format!("hvd-discover-{}.sh", std::process::id());
        std::fs::write(&name, "echo a\n").unwrap();
        let none = std::ffi::OsString::from(dir.display().to_string());
        assert_eq!(discovery_command(&name, Some(&none)), format!("./{name}"));
        std::fs::write(dir.join(&name), "echo a\n").unwrap();
        assert_eq!(
            discovery_command(&name, Some(&none)),
            name,
            "PATH's comes first"
        );
        std::fs::remove_file(&name).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(discovery_command("missing.sh", None), "missing.sh");
        assert_eq!(discovery_command("./d.sh", None), "./d.sh");
        assert_eq!(discovery_command("python3 d.py", None), "python3 d.py");
    }

    #[test]
    fn check_build_has_horovods_layout() {
        let r = check_build_report(true);
        assert!(r.contains("Available Frameworks:\n    [ ] TensorFlow\n    [X] PyTorch"));
        assert!(r.contains("Available Controllers:\n    [ ] MPI\n    [X] Gloo"));
        assert!(r.contains("    [ ] NCCL\n"));
        assert!(check_build_report(false).contains("[ ] PyTorch"));
    }
}
