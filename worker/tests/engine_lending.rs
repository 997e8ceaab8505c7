//! Lending the communicator to the background engine, in a world of one (no launcher).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

use hvd::{EngineConfig, Error, ReduceOp};

#[test]
fn synchronous_calls_fail_clearly_while_the_engine_holds_the_communicator() {
    hvd::init().unwrap();
    let engine = hvd::start_engine(EngineConfig::default()).unwrap();
    let err = hvd::allreduce(&mut [1.0f32], ReduceOp::Sum).unwrap_err();
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
