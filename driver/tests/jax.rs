//! `hvd.jax` end to end, with real JAX (CPU), optax and Flax from the test virtualenv of
//! `support::pyenv`: `python/tests/jax_api.py` under `horovodrun` at 1, 2 and 3 ranks (every
//! collective on arrays and pytrees, eager and inside `jax.jit`, the gradient of an
//! allreduce, `DistributedOptimizer` on optax, `broadcast_parameters`, and the refusals every
//! rank raises instead of waiting), and `examples/python/jax_elastic.py` (a Flax model, optax,
//! `JaxState`, `ElasticSampler`) through a SIGKILLed worker and hosts added and removed.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::process::Command;

use nix::sys::signal::Signal;
use support::pyenv::{elastic_script, passes_on, python, root};
use support::{check_counter, signal};

#[test]
fn the_jax_api_matches_its_references_on_1_2_and_3_ranks() {
    passes_on("jax_api.py", "jax", &[1, 2, 3]);
}

/// The latency example's JAX mode: a 4-byte allreduce eager, inside `jax.jit`, and a chain of
/// them in one jit, each checked on every rank and reported.
#[test]
fn the_latency_example_reports_jax_calls_eager_and_jitted() {
    let out = Command::new(env!("CARGO_BIN_EXE_horovodrun"))
        .args(["-np", "2", "-H", "127.0.0.1:2"])
        .arg(python())
        .arg(root().join("examples/python/allreduce_latency.py"))
        .args([
            "--framework",
            "jax",
            "--iters",
            "50",
            "--warmup",
            "10",
            "--chain",
            "5",
        ])
        .output()
        .expect("horovodrun");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for what in [
        "hvd.jax.allreduce (eager) of 4 B from Python on 2 ranks: mean ",
        "hvd.jax.allreduce (jax.jit) of 4 B from Python on 2 ranks: mean ",
        "hvd.jax.allreduce in a jax.jit of 5, each, beyond the call of 4 B",
    ] {
        assert!(text.contains(what), "{what}: {text}");
    }
}

/// The elastic example loses a worker to SIGKILL in its first epoch, gains a host, then
/// loses one gracefully: every epoch trained every sample, every rank ended each epoch with
/// the same parameters, and the model learnt.
#[test]
fn the_elastic_jax_example_trains_every_sample_through_a_kill_and_host_changes() {
    let mut job = elastic_script(
        "jax-elastic",
        &["127.0.0.2:2", "127.0.0.3:2"],
        &["-np", "4", "--min-np", "2", "--max-np", "4"],
        "examples/python/jax_elastic.py",
        &["--epochs", "5", "--batch-ms", "60"],
    );
    job.wait_for("the first step's epoch at size 4", |l| {
        l.v["event"] == "epoch" && l.v["size"] == 4
    });
    let victim = job
        .workers()
        .into_iter()
        .find(|w| w.2 == "127.0.0.3")
        .expect("a worker on 127.0.0.3")
        .0;
    signal(victim, Signal::SIGKILL);
    job.wait_for("an epoch at size 2", |l| {
        l.v["event"] == "epoch" && l.v["size"] == 2
    });
    job.set_hosts(&["127.0.0.2:2", "127.0.0.4:2"]);
    job.wait_for("an epoch at size 4 again", |l| {
        l.v["event"] == "epoch" && l.v["size"] == 4 && l.v["epoch"].as_u64() > Some(1)
    });
    job.set_hosts(&["127.0.0.2:2"]);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    for e in support::trained_epochs(&lines, 5) {
        assert_eq!(e["params_spread"], 0.0, "{e}");
    }
    assert!(
        err.contains("worker failed") && err.contains("host left discovery"),
        "{err}"
    );
}

/// The JAX counter (`python/tests/jax_elastic_train.py`: a `JaxState`, a jitted optax step
/// through `DistributedOptimizer`) loses a worker to SIGKILL: every committed step applied
/// once, and the weight the optimizer moved equals the steps on every rank.
#[test]
fn the_jax_counter_loses_no_committed_step_to_a_killed_worker() {
    let mut job = elastic_script(
        "jax-counter",
        &["127.0.0.2:2", "127.0.0.3:2"],
        &["-np", "4", "--min-np", "2"],
        "python/tests/jax_elastic_train.py",
        &["--steps", "150", "--commit-every", "5", "--step-ms", "20"],
    );
    job.wait_step(15, 4);
    let victim = job.pids_on("127.0.0.3")[0];
    signal(victim, Signal::SIGKILL);
    job.wait_step(1, 2);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 150), 2);
    for l in lines.iter().filter(|l| l.v["event"] == "done") {
        assert_eq!(l.v["weight"], -150.0, "{}", l.v);
    }
}
