//! Horovod's knob variables as the worker reads them: autotune, the stall check, thread
//! affinity, NCCL streams and logging; each malformed value named with its variable.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

use std::collections::HashMap;
use std::time::Duration;

fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
        .collect()
}

/// The error `engine_config_from` gives for `var=value`, checked to name both.
fn refused(var: &str, value: &str) -> String {
    let e = hvd::engine_config_from(&env(&[("HOROVOD_AUTOTUNE", "1"), (var, value)]))
        .unwrap_err()
        .to_string();
    assert!(e.contains(var) && e.contains(&format!("'{value}'")), "{e}");
    e
}

#[test]
fn autotune_reads_its_settings_and_holds_the_knobs_set_explicitly() {
    assert!(
        hvd::engine_config_from(&env(&[]))
            .unwrap()
            .autotune
            .is_none()
    );
    assert!(
        hvd::engine_config_from(&env(&[("HOROVOD_AUTOTUNE", "0")]))
            .unwrap()
            .autotune
            .is_none()
    );
    let cfg = hvd::engine_config_from(&env(&[
        ("HOROVOD_AUTOTUNE", "1"),
        ("HOROVOD_AUTOTUNE_LOG", "/tmp/at.csv"),
        ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "0"),
        ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "4"),
        ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "7"),
        ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "0.25"),
        ("HOROVOD_CYCLE_TIME", "3"),
        ("HOROVOD_HIERARCHICAL_ALLGATHER", "0"),
    ]))
    .unwrap();
    let a = cfg.autotune.unwrap();
    assert_eq!(a.log.as_deref(), Some(std::path::Path::new("/tmp/at.csv")));
    assert_eq!(
        (a.warmup_samples, a.steps_per_sample, a.max_samples, a.noise),
        (0, 4, 7, 0.25)
    );
    assert_eq!(
        a.held,
        hvd::Held {
            cycle: true,
            hierarchical_allgather: true,
            ..hvd::Held::default()
        }
    );
    let d = hvd::engine_config_from(&env(&[("HOROVOD_AUTOTUNE", "1")]))
        .unwrap()
        .autotune
        .unwrap();
    assert_eq!(d, hvd::AutotuneConfig::default());
    assert_eq!(
        (d.warmup_samples, d.steps_per_sample, d.max_samples),
        (3, 10, 20)
    );
    refused("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "0");
    refused("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "many");
    refused("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "-1");
    refused("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "1.5");
    refused("HOROVOD_AUTOTUNE", "yes");
}

#[test]
fn the_stall_check_has_horovod_s_three_variables() {
    let d = hvd::engine_config_from(&env(&[])).unwrap();
    assert_eq!(
        (d.stall_warning, d.stall_shutdown, d.stall_check),
        (Duration::from_secs(60), Duration::ZERO, true)
    );
    let cfg = hvd::engine_config_from(&env(&[
        ("HOROVOD_STALL_CHECK_TIME_SECONDS", "30"),
        ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "120"),
        ("HOROVOD_STALL_CHECK_DISABLE", "1"),
    ]))
    .unwrap();
    assert_eq!(
        (cfg.stall_warning, cfg.stall_shutdown, cfg.stall_check),
        (Duration::from_secs(30), Duration::from_secs(120), false)
    );
    refused("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "later");
    refused("HOROVOD_STALL_CHECK_DISABLE", "true");
    // Horovod's switches: an integer above 0 is on, 0 or below off.
    let on = |v: &str| {
        hvd::engine_config_from(&env(&[("HOROVOD_STALL_CHECK_DISABLE", v)]))
            .unwrap()
            .stall_check
    };
    assert!(!on("2") && !on("1") && on("0") && on("-1"));
    assert!(
        hvd::engine_config_from(&env(&[("HOROVOD_AUTOTUNE", "3")]))
            .unwrap()
            .autotune
            .is_some()
    );
}

#[test]
fn affinity_and_nccl_streams_are_checked() {
    let cfg = hvd::engine_config_from(&env(&[
        ("HOROVOD_THREAD_AFFINITY", "0"),
        ("HOROVOD_NUM_NCCL_STREAMS", "2"),
    ]))
    .unwrap();
    assert_eq!(cfg.thread_affinity, Some(0));
    refused("HOROVOD_THREAD_AFFINITY", "core1");
    // As Horovod: one core per local rank, this rank's by its local rank; a list shorter than
    // the host's ranks pins nothing.
    let pinned = |pairs: &[(&str, &str)]| {
        hvd::engine_config_from(&env(pairs))
            .unwrap()
            .thread_affinity
    };
    let list = ("HOROVOD_THREAD_AFFINITY", "4,5,6,7");
    assert_eq!(
        pinned(&[
            list,
            ("HOROVOD_LOCAL_RANK", "2"),
            ("HOROVOD_LOCAL_SIZE", "4")
        ]),
        Some(6)
    );
    assert_eq!(
        pinned(&[
            list,
            ("HOROVOD_LOCAL_RANK", "0"),
            ("HOROVOD_LOCAL_SIZE", "4")
        ]),
        Some(4)
    );
    assert_eq!(
        pinned(&[
            ("HOROVOD_THREAD_AFFINITY", "3"),
            ("HOROVOD_LOCAL_RANK", "1"),
            ("HOROVOD_LOCAL_SIZE", "2")
        ]),
        None
    );
    refused("HOROVOD_THREAD_AFFINITY", "1,x");
    refused("HOROVOD_NUM_NCCL_STREAMS", "0");
    // The engine runs pinned to an allowed core, and refuses one the process may not use.
    let e = hvd::Engine::start(hvd::Communicator::single(), cfg).unwrap();
    let v = e
        .allreduce_async("x", vec![1.0f32], hvd::ReduceOp::Sum)
        .wait()
        .unwrap();
    assert_eq!(v, vec![1.0]);
    let far = hvd::EngineConfig {
        thread_affinity: Some(100_000),
        ..hvd::EngineConfig::default()
    };
    let err = hvd::Engine::start(hvd::Communicator::single(), far)
        .unwrap_err()
        .to_string();
    assert!(err.contains("core 100000"), "{err}");
}

#[test]
fn log_settings_follow_horovod_s_level_unless_rust_log_is_set() {
    let s = |pairs: &[(&str, &str)]| hvd::log_settings_from(&env(pairs), "warn");
    assert_eq!(
        s(&[]).unwrap(),
        hvd::LogSettings {
            filter: "warn".into(),
            hide_time: false
        }
    );
    for (level, want) in [
        ("TRACE", "trace"),
        ("debug", "debug"),
        ("Info", "info"),
        ("WARNING", "warn"),
        ("error", "error"),
        ("FATAL", "error"),
    ] {
        assert_eq!(s(&[("HOROVOD_LOG_LEVEL", level)]).unwrap().filter, want);
    }
    let both = s(&[
        ("HOROVOD_LOG_LEVEL", "DEBUG"),
        ("RUST_LOG", "hvd=trace"),
        ("HOROVOD_LOG_HIDE_TIME", "1"),
    ])
    .unwrap();
    assert_eq!(
        both,
        hvd::LogSettings {
            filter: "hvd=trace".into(),
            hide_time: true
        }
    );
    let e = s(&[("HOROVOD_LOG_LEVEL", "LOUD")]).unwrap_err().to_string();
    assert!(
        e.contains("HOROVOD_LOG_LEVEL") && e.contains("'LOUD'"),
        "{e}"
    );
    let e = s(&[("HOROVOD_LOG_HIDE_TIME", "yes")])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("HOROVOD_LOG_HIDE_TIME") && e.contains("'yes'"),
        "{e}"
    );
}
