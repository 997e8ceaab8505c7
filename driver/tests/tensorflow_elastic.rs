//! Elastic TensorFlow and Keras on hvd's one elastic core, with real TensorFlow from the
//! test virtualenv: `python/tests/keras_elastic_train.py`, the counter of
//! `elastic_train.py` in Keras (Keras 3, and Keras 2 through `model.fit` under
//! `TF_USE_LEGACY_KERAS=1`), through killed workers and hosts added and removed. Every
//! committed step is applied exactly once: the counter's total is the sum of the sizes it
//! ran at, and the model's one weight took one SGD step per training step.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::time::Duration;

use nix::sys::signal::Signal;
use support::pyenv::{elastic_script_with_env, passes_on};
use support::{Job, assert_weights, check_counter, signal, steps_rerun};

const SCRIPT: &str = "python/tests/keras_elastic_train.py";
/// Seconds a worker has to start and register: importing TensorFlow takes over 30 s when
/// several workers import it at once on a loaded 2-core machine.
const START: &str = "180";
/// How long the rest of a job may take once its last change is seen: five TensorFlow
/// processes step slowly on two cores.
const FINISH: Duration = Duration::from_secs(400);

/// `TensorFlowKerasState` rolls back every kind of write since its commit, keeps the commit
/// intact through later writes, and refuses a model built differently on one rank on every
/// rank at its sync.
#[test]
fn a_tensorflow_state_rolls_back_exactly_and_refuses_mismatched_models() {
    passes_on("tensorflow_state.py", "tensorflow state", &[1, 2]);
}

/// The counter with `args` as 3 workers (127.0.0.2:2 and 127.0.0.3:1, up to `max_np`), with
/// `env` set, once it has lost rank 2, 127.0.0.3's only worker (its host is blacklisted, the
/// other stays), and goes on at size 2.
fn after_a_killed_worker(name: &str, args: &[&str], max_np: &str, env: &[(&str, &str)]) -> Job {
    let flags = [
        "-np",
        "3",
        "--min-np",
        "2",
        "--max-np",
        max_np,
        "--start-timeout",
        START,
    ];
    let hosts = ["127.0.0.2:2", "127.0.0.3:1"];
    let mut job = elastic_script_with_env(name, &hosts, &flags, SCRIPT, args, env);
    job.wait_step(15, 3);
    signal(job.pid_of_rank(2), Signal::SIGKILL);
    job.wait_step(1, 2);
    job
}

/// A custom training loop (`TensorFlowKerasState`, `tf.function` steps, hvd's Keras
/// `DistributedOptimizer`) loses a worker, gains a host and loses one gracefully.
#[test]
fn a_keras_training_loop_survives_a_killed_worker_and_hosts_added_and_removed() {
    // Long enough for new workers to import TensorFlow and join on a loaded machine.
    let args = ["--steps", "1500", "--commit-every", "5", "--step-ms", "20"];
    let mut job = after_a_killed_worker("tf-loop", &args, "4", KERAS_3);
    job.set_hosts(&["127.0.0.2:2", "127.0.0.4:2"]);
    job.wait_step(1, 4);
    job.set_hosts(&["127.0.0.4:2"]);
    job.wait_step(1, 2);
    let (code, err, lines) = job.finish_within(FINISH);
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 1500), 2);
    assert_weights(&lines, 1500);
    // The two that finish joined with the new host: their reset callbacks ran at the
    // removal only (a new worker's first pass runs none, as in Horovod).
    for d in lines.iter().filter(|l| l.v["event"] == "done") {
        assert_eq!(d.v["resets"], 1, "{}", d.v);
    }
    // Only the failure rolls back: at most the steps since a commit (every 5), per survivor.
    let rerun = steps_rerun(&lines);
    assert!(rerun <= 2 * 5, "{rerun} steps re-run");
}

/// `model.fit` with `KerasState` and Horovod's elastic callbacks (epochs of 5 steps,
/// committed at their end) loses a worker and gains a host.
#[test]
fn keras_fit_with_the_elastic_callbacks_survives_a_killed_worker_and_a_new_host() {
    fit_through_a_killed_worker_and_a_new_host("tf-fit", KERAS_3);
}

/// The same on Keras 2: `TF_USE_LEGACY_KERAS=1` makes `tf.keras` `tf_keras`, and
/// `hvd.tensorflow.keras` (its `DistributedOptimizer`, `KerasState` and callbacks) serves it.
#[test]
fn keras_2_fit_with_the_elastic_callbacks_survives_a_killed_worker_and_a_new_host() {
    fit_through_a_killed_worker_and_a_new_host("tf-fit-keras2", &[("TF_USE_LEGACY_KERAS", "1")]);
}

/// `tf.keras` is Keras 3 whatever the caller's environment says.
const KERAS_3: &[(&str, &str)] = &[("TF_USE_LEGACY_KERAS", "0")];

fn fit_through_a_killed_worker_and_a_new_host(name: &str, env: &[(&str, &str)]) {
    let args = [
        "--fit",
        "--steps",
        "1000",
        "--commit-every",
        "5",
        "--step-ms",
        "20",
    ];
    let mut job = after_a_killed_worker(name, &args, "5", env);
    job.set_hosts(&["127.0.0.2:2", "127.0.0.4:3"]);
    job.wait_step(1, 5);
    let (code, err, lines) = job.finish_within(FINISH);
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 1000), 5);
    assert_weights(&lines, 1000);
}
