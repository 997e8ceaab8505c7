//! Lending the communicator to the background engine, in a world of one (no launcher).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

use hvd::{EngineConfig, Error, ReduceOp};

#[test]
fn synchronous_calls_fail_clearly_while_the_engine_holds_the_communicator() {
    hvd::init().unwrap();
    let engine = hvd::start_engine(EngineConfig::default()).unwrap();
    // allreduce goes through the engine (what elastic commits need); the others refuse.
    let mut y = [5.0f32];
    hvd::allreduce(&mut y, ReduceOp::Sum).unwrap();
    assert_eq!(y, [5.0]);
    let err = hvd::broadcast(&mut [1.0f32], 0).unwrap_err();
    assert!(matches!(err, Error::EngineActive), "{err}");
    assert!(err.to_string().contains("hvd::stop_engine"), "{err}");
    assert!(matches!(
        hvd::start_engine(EngineConfig::default()),
        Err(Error::EngineActive)
    ));
    let v = engine
        .allreduce_async("g", vec![3i32, 4], ReduceOp::Sum)
        .wait()
        .unwrap();
    assert_eq!(v, vec![3, 4]);
    hvd::stop_engine(engine).unwrap();
    let mut x = [2.0f64];
    hvd::allreduce(&mut x, ReduceOp::Sum).unwrap();
    assert_eq!(x, [2.0]);
    hvd::shutdown().unwrap();
}

#[test]
fn engine_settings_come_from_horovod_s_variables() {
    use std::collections::HashMap;
    use std::time::Duration;
    let env: HashMap<String, String> = [
        ("HOROVOD_CYCLE_TIME", "2.5"),
        ("HOROVOD_FUSION_THRESHOLD", "0"),
        ("HOROVOD_STALL_CHECK_TIME_SECONDS", "7"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let cfg = hvd::engine_config_from(&env).unwrap();
    assert_eq!(cfg.cycle, Duration::from_micros(2500));
    assert_eq!(cfg.fusion_bytes, 0);
    assert_eq!(cfg.stall_timeout, Duration::from_secs(7));
    let bad: HashMap<String, String> =
        [("HOROVOD_CYCLE_TIME".to_string(), "-1".to_string())].into();
    let e = hvd::engine_config_from(&bad).unwrap_err().to_string();
    assert!(e.contains("HOROVOD_CYCLE_TIME") && e.contains("-1"), "{e}");
}
