//! `hvd.tensorflow` end to end, with real TensorFlow (the test virtualenv of
//! `support::pyenv`): `python/tests/tensorflow_ops.py` under `horovodrun` on 1, 2 and 3
//! ranks, every result checked in the script against a reference it computes (every op and
//! dtype, eagerly and inside `tf.function`, gradients, `DistributedGradientTape`, the legacy
//! `DistributedOptimizer`, process sets, the errors); and the TensorFlow latency example, whose
//! every 4-byte allreduce (eager and in a `tf.function`) checks its sum.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use support::pyenv::{python, root};
use support::{Job, scratch};

/// Longest one run may take: 3 TensorFlow ranks on a loaded 2-core machine take minutes.
const LIMIT: Duration = Duration::from_secs(900);

/// Runs `script` (relative to the repository) with `args` as `np` ranks on this host through
/// `horovodrun`; every line of `expect` must be printed, within [`LIMIT`], and the job must
/// succeed. `env` is set for the job. Returns the lines the workers printed.
fn runs_printing(
    np: usize,
    script: &str,
    args: &[&str],
    env: &[(&str, &str)],
    expect: &[String],
) -> Vec<String> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_horovodrun"));
    cmd.envs(env.iter().copied());
    // Importing TensorFlow takes tens of seconds when several ranks import it at once on a
    // loaded 2-core machine.
    cmd.args(["-np", &np.to_string(), "-H", &format!("127.0.0.1:{np}")])
        .args(["--start-timeout", "300"])
        .arg(python())
        .arg(root().join(script))
        .args(args);
    let name = script.rsplit('/').next().unwrap_or(script);
    let tag: String = env.iter().map(|(k, _)| format!("-{k}")).collect();
    let mut job = Job::spawn(scratch(&format!("tf-{name}-{np}{tag}")), cmd);
    let deadline = Instant::now() + LIMIT;
    for want in expect {
        let left = deadline.saturating_duration_since(Instant::now());
        let seen = job.try_wait_for(
            |l| l.v.as_str().is_some_and(|s| s.starts_with(want.as_str())),
            left,
        );
        assert!(
            seen.is_some(),
            "{np} ranks of {script}: never saw '{want}'; lines: {:?}\nstderr:\n{}",
            job.tail(),
            job.err_tail()
        );
    }
    let (code, err, lines) = job.finish();
    let text: Vec<String> = lines
        .iter()
        .filter_map(|l| l.v.as_str().map(str::to_owned))
        .collect();
    assert_eq!(code, 0, "{np} ranks of {script}: {text:?}\n{err}");
    text
}

/// One run at a time: each rank is a TensorFlow process, and side by side they would only
/// slow each other down.
#[test]
fn every_tensorflow_collective_matches_its_reference_on_1_2_and_3_ranks() {
    for np in [1, 2, 3] {
        let expect: Vec<String> = (0..np)
            .map(|rank| format!("tensorflow ok: rank {rank} of {np}"))
            .collect();
        runs_printing(np, "python/tests/tensorflow_ops.py", &[], &[], &expect);
    }
}

/// Inside `tf.function` the same checks pass where hvd's compiled op is turned off, and where
/// it cannot be built (no working compiler, a cache of its own): allreduces are then
/// `numpy_function` nodes, and the script checks that they are.
#[test]
fn tensorflow_collectives_are_right_without_the_compiled_op() {
    let expect = |np: usize| -> Vec<String> {
        (0..np)
            .map(|rank| format!("tensorflow ok: rank {rank} of {np}"))
            .collect()
    };
    let script = "python/tests/tensorflow_ops.py";
    let numpy = ("HVD_TEST_GRAPH_OPS", "numpy");
    let off = [numpy, ("HVD_TF_GRAPH_OPS", "0")];
    runs_printing(2, script, &[], &off, &expect(2));
    let dir = scratch("tf-graph-ops-cache");
    let cache = dir.to_str().expect("a UTF-8 path");
    let broken = [numpy, ("CXX", "false"), ("HVD_CACHE_DIR", cache)];
    runs_printing(1, script, &[], &broken, &expect(1));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every call of the example checks that the 4-byte sum is the world's size; rank 0 reports
/// the eager and the `tf.function` figures.
#[test]
fn a_4_byte_tensorflow_allreduce_is_right_eagerly_and_in_tf_function() {
    let expect = [
        "hvd.tensorflow.allreduce (eager) of 4 B from Python on 2 ranks: mean ".to_owned(),
        "hvd.tensorflow.allreduce (tf.function) of 4 B from Python on 2 ranks: mean ".to_owned(),
    ];
    let lines = runs_printing(
        2,
        "examples/python/allreduce_latency.py",
        &[
            "--framework",
            "tensorflow",
            "--iters",
            "50",
            "--warmup",
            "5",
        ],
        &[],
        &expect,
    );
    assert!(
        lines.iter().filter(|l| l.contains("over 50 calls")).count() >= 2,
        "{lines:?}"
    );
}
