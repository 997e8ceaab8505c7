//! Lending the communicator to the background engine, in a world of one (no launcher).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

use hvd::{EngineConfig, Error, ReduceOp};

#[test]
fn synchronous_calls_go_through_the_engine_while_it_holds_the_communicator() {
    hvd::init().unwrap();
    let engine = hvd::start_engine(EngineConfig::default()).unwrap();
    // Every synchronous collective is a named op on the engine, waited for.
    let mut y = [5.0f32];
    hvd::allreduce(&mut y, ReduceOp::Sum).unwrap();
    assert_eq!(y, [5.0]);
    let mut b = [1.0f32, 2.0];
    hvd::broadcast(&mut b, 0).unwrap();
    assert_eq!(b, [1.0, 2.0]);
    assert_eq!(hvd::allgather(&[7u8, 8], 2).unwrap(), vec![7, 8]);
    assert_eq!(
        hvd::reducescatter(&[3i64; 4], ReduceOp::Sum).unwrap(),
        vec![3; 4]
    );
    assert_eq!(
        hvd::alltoall(&[1i32, 2], &[2]).unwrap(),
        (vec![1, 2], vec![2])
    );
    let (mut g1, mut g2) = ([1.0f64; 3], [2.0f64; 2]);
    hvd::grouped_allreduce(&mut [&mut g1[..], &mut g2[..]], ReduceOp::Sum).unwrap();
    assert_eq!((g1, g2), ([1.0; 3], [2.0; 2]));
    hvd::barrier().unwrap();
    // Only direct use of the communicator is refused.
    let err = hvd::with_communicator(|c| c.barrier()).unwrap_err();
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
        ("HOROVOD_CACHE_CAPACITY", "16"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let cfg = hvd::engine_config_from(&env).unwrap();
    assert_eq!(cfg.cycle, Duration::from_micros(2500));
    assert_eq!(cfg.fusion_bytes, 0);
    assert_eq!(cfg.stall_warning, Duration::from_secs(7));
    assert_eq!(cfg.stall_shutdown, Duration::ZERO, "never, unless set");
    assert!(cfg.stall_check);
    assert!(cfg.autotune.is_none());
    assert_eq!(cfg.cache_capacity, 16);
    let bad: HashMap<String, String> =
        [("HOROVOD_CACHE_CAPACITY".to_string(), "1.5".to_string())].into();
    let e = hvd::engine_config_from(&bad).unwrap_err().to_string();
    assert!(
        e.contains("HOROVOD_CACHE_CAPACITY") && e.contains("1.5"),
        "{e}"
    );
    let bad: HashMap<String, String> =
        [("HOROVOD_CYCLE_TIME".to_string(), "-1".to_string())].into();
    let e = hvd::engine_config_from(&bad).unwrap_err().to_string();
    assert!(e.contains("HOROVOD_CYCLE_TIME") && e.contains("-1"), "{e}");
}
