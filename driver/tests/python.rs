//! The `hvd` Python package end to end, with real PyTorch: a virtualenv under `target/pyenv`
//! with torch from PyPI (`python/requirements-test.txt`) and the package built from
//! `./python` by maturin, both installed on first use; then Python scripts under
//! `horovodrun`, every result checked against a reference computed in the script: the
//! collectives (`python/tests/collectives.py`) and `DistributedOptimizer`
//! (`python/tests/optimizer.py`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

#[path = "support/browser.rs"]
mod browser;
mod support;

use std::path::Path;
use std::process::Command;

use nix::sys::signal::Signal;
use support::pyenv::{elastic_script, passes_on, python, root, target_dir};
use support::{Job, assert_weights, check_counter, scratch, signal, steps_rerun};

/// `horovodrun` running the Python script `script` as `np` ranks on this host.
fn under_hvd(np: usize, script: &Path) -> Command {
    under_hvd_on(&format!("127.0.0.1:{np}"), np, script)
}

/// `horovodrun` running the Python script `script` as `np` ranks on `hosts` (`-H`).
fn under_hvd_on(hosts: &str, np: usize, script: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_horovodrun"));
    cmd.args(["-np", &np.to_string(), "-H", hosts])
        .arg(python())
        .arg(script);
    cmd
}

/// Runs `cmd` to success (`what` names it in the failure) and returns its stdout.
fn stdout_of(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().expect("horovodrun");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what}:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// `torchrun` running the Python script `script` as `np` ranks, its store on a free port.
fn under_torchrun(np: usize, script: &Path) -> Command {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let mut cmd = Command::new(python());
    cmd.args([
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        &np.to_string(),
    ])
    .arg(format!("--master_port={port}"))
    .arg(script);
    cmd
}

#[test]
fn every_collective_dtype_and_op_matches_its_reference_on_1_to_4_ranks() {
    passes_on("collectives.py", "collectives", &[1, 2, 3, 4]);
}

#[test]
fn the_distributed_optimizer_trains_as_one_process_on_the_union_of_the_batches() {
    passes_on("optimizer.py", "optimizer", &[1, 2, 3]);
}

/// `TorchState` rolls back every kind of write since its commit, and never lends the
/// commit's memory to the live model or optimizer.
#[test]
fn a_torch_state_rolls_back_exactly_what_changed_since_its_commit() {
    passes_on("torch_state.py", "torch state", &[1]);
}

#[test]
fn sync_batch_norm_normalizes_over_the_union_of_the_batches() {
    passes_on("sync_batch_norm.py", "sync_batch_norm", &[1, 2, 3]);
}

/// `op=hvd.Adasum` against a NumPy reference of the same recursion, on world sizes that are
/// powers of two and others (an elastic world shrinks to 3), and on ranks spread over hosts.
#[test]
fn adasum_matches_its_numpy_reference_on_2_to_8_ranks() {
    passes_on("adasum.py", "adasum", &[2, 3, 4, 5, 8]);
    let script = root().join("python/tests/adasum.py");
    let text = stdout_of(
        &mut under_hvd_on("127.0.0.2:1,127.0.0.3:2", 3, &script),
        "3 ranks on two hosts",
    );
    assert_eq!(text.matches("adasum ok: rank").count(), 3, "{text}");
}

/// `hvd.join()` while the other ranks train with synchronous ops only, with asynchronous
/// ones while the joining rank never started its engine, on one host and over TCP.
#[test]
fn join_works_while_other_ranks_train_with_synchronous_or_asynchronous_ops() {
    for mode in ["sync", "async"] {
        for hosts in ["127.0.0.1:3", "127.0.0.2:1,127.0.0.3:2"] {
            let script = root().join("python/tests/join.py");
            let what = format!("{mode} on {hosts}");
            let text = stdout_of(
                under_hvd_on(hosts, 3, &script).args(["--mode", mode]),
                &what,
            );
            for rank in 0..3 {
                assert!(
                    text.contains(&format!("join ok: rank {rank} of 3")),
                    "{what}, rank {rank}:\n{text}"
                );
            }
        }
    }
}

#[test]
fn a_script_run_without_horovodrun_is_a_world_of_one() {
    let out = Command::new(python())
        .arg(root().join("python/tests/collectives.py"))
        .env_remove("HVD_RENDEZVOUS_ADDR")
        .output()
        .expect("python");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("collectives ok: rank 0 of 1,"),
        "{stdout}\n{stderr}"
    );
}

const TRAIN: &[&str] = &["--steps", "150", "--commit-every", "5", "--step-ms", "20"];

/// `python/tests/elastic_train.py` as an elastic job over `hosts` (what discovery prints).
fn elastic_job(name: &str, hosts: &[&str], flags: &[&str]) -> Job {
    elastic_script(name, hosts, flags, "python/tests/elastic_train.py", TRAIN)
}

#[test]
fn an_elastic_torch_job_survives_a_killed_worker_without_losing_a_step() {
    let hosts = ["127.0.0.2:2", "127.0.0.3:2"];
    let mut job = elastic_job("py-kill", &hosts, &["-np", "4", "--min-np", "2"]);
    job.wait_step(15, 4);
    signal(job.pid_of_rank(3), Signal::SIGKILL);
    job.wait_step(1, 2);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    // Every committed step applied once: total == sum of sizes, and the model's weight
    // (one SGD step per training step) is exactly -steps on every rank.
    assert_eq!(check_counter(&lines, 150), 2);
    for d in lines.iter().filter(|l| l.v["event"] == "done") {
        assert_eq!(d.v["weight"], -150.0, "{}", d.v);
        assert_eq!(d.v["resets"], 1, "the reset callbacks ran once: {}", d.v);
    }
    // A survivor re-runs at most the steps since its last commit (every 5 steps).
    let rerun = steps_rerun(&lines);
    assert!(rerun <= 2 * 5, "{rerun} steps re-run by 2 survivors");
}

/// `DistributedOptimizer(op=hvd.Adasum)` through a failure and a host added: every rank's
/// gradient is the same, so every committed step moves the weight by exactly one.
#[test]
fn an_elastic_adasum_job_survives_a_killed_worker_and_a_new_host() {
    // Long enough for three new workers to import torch on a loaded machine and join.
    let args = [
        "--steps",
        "1000",
        "--commit-every",
        "5",
        "--step-ms",
        "20",
        "--op",
        "adasum",
    ];
    let mut job = elastic_script(
        "py-adasum",
        &["127.0.0.2:2", "127.0.0.3:1"],
        &["-np", "3", "--min-np", "2", "--max-np", "5"],
        "python/tests/elastic_train.py",
        &args,
    );
    job.wait_step(15, 3);
    signal(job.pid_of_rank(2), Signal::SIGKILL);
    job.wait_step(1, 2);
    job.set_hosts(&["127.0.0.2:2", "127.0.0.4:3"]);
    job.wait_step(1, 5);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 1000), 5);
    assert_weights(&lines, 1000);
}

#[test]
fn an_elastic_torch_job_grows_when_a_host_is_added() {
    // Long enough for two new workers to import torch and join on a loaded machine.
    let long = ["--steps", "1000", "--commit-every", "5", "--step-ms", "20"];
    let mut job = elastic_script(
        "py-add",
        &["127.0.0.2:2"],
        &["-np", "2", "--min-np", "2", "--max-np", "4"],
        "python/tests/elastic_train.py",
        &long,
    );
    job.wait_step(15, 2);
    job.set_hosts(&["127.0.0.2:2", "127.0.0.3:2"]);
    job.wait_step(1, 4);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 1000), 4);
    assert_weights(&lines, 1000);
    assert_eq!(steps_rerun(&lines), 0, "a host change rolls nothing back");
}

/// Autotune through elastic rounds: the first round (4 ranks on 2 hosts) tunes to the end; a
/// host added makes a new shape (6 on 3), tuned again starting from the first round's
/// setting; the host removed brings back the first shape, whose setting rank 0 keeps without
/// tuning again. Every committed step is applied once throughout.
#[test]
fn autotune_keeps_what_it_tuned_across_elastic_rounds() {
    let log = std::env::temp_dir().join(format!("hvd-autotune-py-{}.csv", std::process::id()));
    let log_arg = log.display().to_string();
    let flags = [
        "-np",
        "4",
        "--min-np",
        "2",
        "--max-np",
        "6",
        "--autotune",
        "--autotune-log-file",
        &log_arg,
        "--autotune-warmup-samples",
        "1",
        "--autotune-steps-per-sample",
        "1",
        "--autotune-bayes-opt-max-samples",
        "3",
        "--log-level",
        "INFO",
    ];
    let two = ["127.0.0.2:2", "127.0.0.3:2"];
    let steps = ["--steps", "1500", "--commit-every", "5", "--step-ms", "5"];
    let script = "python/tests/elastic_train.py";
    let job = elastic_script("py-autotune", &two, &flags, script, &steps);
    const BEST: &str = "autotune: best params";
    job.wait_stderr_count(BEST, 1);
    job.set_hosts(&["127.0.0.2:2", "127.0.0.3:2", "127.0.0.4:2"]);
    job.wait_stderr_count("starting from the setting tuned before", 1);
    job.wait_stderr_count(BEST, 2);
    job.set_hosts(&two);
    job.wait_stderr_count(
        "keeping the setting tuned on an earlier round of this shape",
        1,
    );
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 1500), 4);
    assert_weights(&lines, 1500);
    // The third round trained: steps at size 4 after the last one at size 6.
    let step_at =
        |size: u64| move |l: &&support::Line| l.v["event"] == "step" && l.v["size"] == size;
    let last_six = lines.iter().filter(step_at(6)).map(|l| l.at).max();
    assert!(last_six.is_some(), "no step at size 6");
    assert!(
        lines
            .iter()
            .filter(step_at(4))
            .any(|l| Some(l.at) > last_six),
        "no step at size 4 after the round of 6"
    );
    // Two rounds tuned (their samples and best rows are in the log); the third did not.
    assert_eq!(err.matches("autotune: tunable params").count(), 2, "{err}");
    assert_eq!(err.matches(BEST).count(), 2, "{err}");
    // The workers' log lines reach horovodrun through pipes: no colour codes in them.
    assert!(
        !err.contains('\u{1b}'),
        "colour codes in the workers' log lines"
    );
    let text = std::fs::read_to_string(&log).expect("the autotune log");
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("hierarchical"))
            .count(),
        1,
        "{text}"
    );
    assert!(text.lines().count() > 2 * 5, "{text}");
    let _ = std::fs::remove_file(&log);
}

/// Runs `cmd` (a benchmark example) to success and returns its JSON summary line, the one
/// holding `key`.
fn summary(cmd: &mut Command, key: &str) -> serde_json::Value {
    let out = cmd.output().expect("the benchmark runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text
        .lines()
        .filter_map(|l| l.split_once('{').map(|(_, rest)| format!("{{{rest}")))
        .find(|l| l.contains(&format!("\"{key}\"")))
        .unwrap_or_else(|| panic!("no summary line in:\n{text}"));
    serde_json::from_str(&line).expect("the summary is JSON")
}

const BENCH: &[&str] = &[
    "--model",
    "resnet18",
    "--image-size",
    "32",
    "--batch-size",
    "4",
    "--num-warmup-batches",
    "1",
    "--num-batches-per-iter",
    "1",
    "--num-iters",
    "2",
];

#[test]
fn the_synthetic_benchmark_runs_under_hvd_and_under_ddp() {
    let script = root().join("examples/python/pytorch_synthetic_benchmark.py");
    let s = summary(under_hvd(2, &script).args(BENCH), "img_sec_total");
    assert_eq!(
        (s["system"].as_str(), s["ranks"].as_u64()),
        (Some("hvd"), Some(2)),
        "{s}"
    );
    assert!(s["img_sec_total"].as_f64().is_some_and(|r| r > 0.0), "{s}");
    // The same script under torchrun.
    let s = summary(
        under_torchrun(2, &script).arg("--ddp").args(BENCH),
        "img_sec_total",
    );
    assert_eq!(s["system"], "DDP over Gloo", "{s}");
    assert_eq!(s["ranks"], 2, "{s}");
}

#[test]
fn the_latency_example_reports_its_calls() {
    let text = stdout_of(
        under_hvd(2, &root().join("examples/python/allreduce_latency.py"))
            .args(["--iters", "50", "--warmup", "5"]),
        "the latency example",
    );
    assert!(
        text.contains("hvd.allreduce_ of 4 B from Python on 2 ranks: mean ")
            && text.contains("over 50 calls"),
        "{text}"
    );
}

/// A worker killed while the job starts (the workers are still importing torch, none has
/// registered): its host is failed, and the first round forms with the workers left when
/// they are at least `--min-np`, as after any failure, instead of waiting for `-np` slots.
#[test]
fn a_worker_killed_before_the_first_round_leaves_a_smaller_first_round() {
    let hosts = ["127.0.0.2:2", "127.0.0.3:2"];
    let mut job = elastic_job("py-early", &hosts, &["-np", "4", "--min-np", "2"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let victim = loop {
        if let Some(w) = job.workers().into_iter().find(|w| w.2 == "127.0.0.3") {
            break w.0;
        }
        assert!(std::time::Instant::now() < deadline, "no worker started");
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    signal(victim, Signal::SIGKILL);
    job.wait_step(1, 2);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert!(
        !lines
            .iter()
            .any(|l| l.v["event"] == "step" && l.v["size"] == 4),
        "no round of 4 formed"
    );
    assert_eq!(check_counter(&lines, 150), 2);
    assert!(
        err.contains("worker failed") && err.contains("blacklisted"),
        "{err}"
    );
}

/// `examples/python/pytorch_elastic.py` with a worker killed in its second epoch: the job
/// finishes at the smaller size, and every epoch trained every sample.
#[test]
fn the_elastic_example_trains_every_sample_through_a_failure() {
    let mut job = elastic_script(
        "py-example",
        &["127.0.0.2:2", "127.0.0.3:2"],
        &["-np", "4", "--min-np", "2"],
        "examples/python/pytorch_elastic.py",
        &["--epochs", "3", "--batch-ms", "60"],
    );
    job.wait_for("the first epoch at size 4", |l| {
        l.v["event"] == "epoch" && l.v["size"] == 4
    });
    let victim = job
        .workers()
        .into_iter()
        .find(|w| w.2 == "127.0.0.3")
        .expect("a worker on 127.0.0.3")
        .0;
    signal(victim, Signal::SIGKILL);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    let epochs = support::trained_epochs(&lines, 3);
    assert_eq!(epochs[2]["size"], 2, "{epochs:?}");
}

#[test]
fn an_elastic_torch_job_survives_losing_rank_0s_host() {
    let hosts = ["127.0.0.2:2", "127.0.0.3:2"];
    let mut job = elastic_job("py-rank0", &hosts, &["-np", "4", "--min-np", "2"]);
    job.wait_step(15, 4);
    let rank0 = job.pid_of_rank(0);
    let host = job
        .workers()
        .into_iter()
        .find(|w| w.0 == rank0)
        .map(|w| w.2)
        .expect("rank 0's host");
    for pid in job.pids_on(&host) {
        signal(pid, Signal::SIGKILL);
    }
    job.wait_step(1, 2);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 150), 2);
    assert_weights(&lines, 150);
}

#[test]
fn an_elastic_torch_job_shrinks_gracefully_when_a_host_is_removed() {
    let hosts = ["127.0.0.2:2", "127.0.0.3:2"];
    let mut job = elastic_job("py-remove", &hosts, &["-np", "4", "--min-np", "2"]);
    job.wait_step(15, 4);
    job.set_hosts(&["127.0.0.2:2"]);
    job.wait_step(1, 2);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 150), 2);
    assert_eq!(
        steps_rerun(&lines),
        0,
        "a graceful removal rolls nothing back"
    );
    assert!(!err.contains("worker failed"), "{err}");
}

/// A Python worker computing for three seconds in pure Python, holding the GIL, still answers
/// the driver's pings (a thread of hvd's own answers them, without the GIL): at
/// `--heartbeat-timeout 1` nobody is declared frozen and nothing is reset.
#[test]
fn a_worker_holding_the_gil_for_three_heartbeat_timeouts_is_not_declared_frozen() {
    let flags = ["-np", "4", "--min-np", "2", "--heartbeat-timeout", "1"];
    let args = [
        "--steps",
        "60",
        "--step-ms",
        "10",
        "--gil-busy-at-step",
        "20",
        "--gil-busy-ms",
        "3000",
    ];
    let hosts = ["127.0.0.2:2", "127.0.0.3:2"];
    let mut job = elastic_script(
        "py-gil",
        &hosts,
        &flags,
        "python/tests/elastic_train.py",
        &args,
    );
    job.wait_for("the busy step", |l| l.v["event"] == "busy");
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 60), 4);
    assert!(
        !lines.iter().any(|l| l.v["event"] == "reset"),
        "nothing was reset"
    );
    assert!(!err.contains("stopped answering"), "{err}");
}

/// A worker slowed for real (stopped 60 ms of every 100 ms, as a throttled CPU would be) is
/// found by the engine's lateness measure, and under `--straggler-policy evict` its host leaves
/// the world gracefully: no step lost or applied twice, nothing rolled back, nothing failed.
#[test]
fn a_worker_slowed_by_a_duty_cycle_is_found_and_its_host_evicted_without_losing_a_step() {
    let hosts = ["127.0.0.2:2", "127.0.0.3:2"];
    let flags = [
        "-np",
        "4",
        "--min-np",
        "2",
        "--straggler-policy",
        "evict",
        "--blacklist-cooldown-range",
        "600",
        "600",
    ];
    let args = ["--steps", "400", "--commit-every", "5", "--step-ms", "20"];
    let mut job = elastic_script(
        "py-straggler",
        &hosts,
        &flags,
        "python/tests/elastic_train.py",
        &args,
    );
    job.wait_step(20, 4);
    let victim = job.pid_of_rank(3);
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop = std::sync::Arc::clone(&done);
    let duty = std::thread::spawn(move || {
        while !stop.load(std::sync::atomic::Ordering::SeqCst) && support::alive(victim) {
            signal(victim, Signal::SIGSTOP);
            std::thread::sleep(std::time::Duration::from_millis(60));
            signal(victim, Signal::SIGCONT);
            std::thread::sleep(std::time::Duration::from_millis(40));
        }
    });
    let t = std::time::Instant::now();
    let found = job.wait_stderr("straggler: this rank's step takes");
    let found_after = t.elapsed();
    job.wait_step(1, 2);
    let out_after = t.elapsed();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let _ = duty.join();
    if support::alive(victim) {
        signal(victim, Signal::SIGCONT);
    }
    eprintln!(
        "duty cycle → straggler reported after {found_after:?}, training at size 2 after \
         {out_after:?}: {found}"
    );
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 400), 2);
    assert_eq!(steps_rerun(&lines), 0, "an eviction rolls nothing back");
    assert!(found.contains("host=127.0.0.3"), "{found}");
    assert!(
        err.contains("straggler's host evicted") && !err.contains("worker failed"),
        "{err}"
    );
}

/// The README's spot demo with the PyTorch counter: every check of its timeline passes.
#[test]
fn the_spot_demo_passes_with_the_pytorch_counter() {
    let profile = target_dir().join("debug");
    assert!(
        profile.join("examples/elastic_counter").exists(),
        "run the tests with `cargo test --workspace`, which builds the examples"
    );
    // spot.sh keeps its logs in a directory under TMPDIR: here, a scratch one, removed when
    // the demo passed.
    let tmp = scratch("spot");
    let out = Command::new(root().join("examples/spot/spot.sh"))
        .args(["--debug", "--python"])
        .current_dir(root())
        .env("HVD_PYTHON", python())
        .env("TMPDIR", &tmp)
        .output()
        .expect("spot.sh");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.trim_end().ends_with("PASS"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn the_gradient_sync_benchmark_runs_under_hvd_and_under_gloo() {
    let script = root().join("examples/python/grad_sync_bench.py");
    let small = ["--model", "small", "--iters", "2", "--warmup", "1"];
    let s = summary(under_hvd(2, &script).args(small), "median_ms");
    assert_eq!(
        (s["system"].as_str(), s["tensors"].as_u64()),
        (Some("hvd"), Some(5)),
        "{s}"
    );
    let s = summary(
        under_hvd(3, &script).args(small).args(["--op", "adasum"]),
        "median_ms",
    );
    assert_eq!(
        (s["op"].as_str(), s["ranks"].as_u64()),
        (Some("adasum"), Some(3)),
        "{s}"
    );
    let s = summary(
        under_torchrun(2, &script).arg("--gloo").args(small),
        "median_ms",
    );
    assert_eq!(s["system"], "DDP buckets over Gloo", "{s}");
    assert!(s["median_ms"].as_f64().is_some_and(|m| m > 0.0), "{s}");
}

/// The Adasum chapter's case study: at the learning rate that suits one worker, Adasum
/// reaches the polynomial's coefficients in fewer steps than averaging, and in fewer still
/// with more ranks, while averaging needs about as many as one worker.
#[test]
fn adasum_needs_fewer_steps_than_averaging_at_an_unscaled_learning_rate() {
    let script = root().join("examples/python/adasum_case_study.py");
    let steps = |np: usize| {
        let s = summary(&mut under_hvd(np, &script), "adasum_steps");
        let (avg, ada) = (s["average_steps"].as_u64(), s["adasum_steps"].as_u64());
        (avg.expect("average_steps"), ada.expect("adasum_steps"))
    };
    let (one_avg, one_ada) = steps(1);
    assert_eq!(one_avg, one_ada, "one worker: the two ops are the same");
    let (two_avg, two_ada) = steps(2);
    let (four_avg, four_ada) = steps(4);
    for (np, avg, ada) in [(2, two_avg, two_ada), (4, four_avg, four_ada)] {
        assert!(
            ada * 10 < avg * 8,
            "{np} ranks: Adasum {ada} steps, average {avg}"
        );
        assert!(
            avg * 10 > one_avg * 8,
            "{np} ranks: average {avg} steps, one worker {one_avg}"
        );
    }
    assert!(
        four_ada < two_ada,
        "Adasum on 4 ranks {four_ada}, on 2 {two_ada}"
    );
}

/// The status page in a real browser: headless Chromium loads `/` during a PyTorch job that
/// lost a worker to a kill and a host to a notice, and the page, once its script rendered it,
/// shows the world size over time, both resets with their causes, every rank's lateness, the
/// blacklisted and the noticed host, and the driver's log. A screenshot is kept in target/.
#[test]
fn the_status_page_shows_the_job_in_a_real_browser() {
    let hosts = ["127.0.0.2:2", "127.0.0.3:1", "127.0.0.4:1"];
    let flags = [
        "-np",
        "4",
        "--min-np",
        "2",
        "--status-port",
        "0",
        "--blacklist-cooldown-range",
        "600",
        "600",
    ];
    let args = ["--steps", "1500", "--commit-every", "5", "--step-ms", "20"];
    let mut job = elastic_script(
        "py-status-page",
        &hosts,
        &flags,
        "python/tests/elastic_train.py",
        &args,
    );
    let port = job.status_port();
    job.wait_step(20, 4);
    let killed = job.pids_on("127.0.0.3");
    assert_eq!(killed.len(), 1, "{:?}", job.workers());
    signal(killed[0], Signal::SIGKILL);
    job.wait_step(1, 3);
    let noticed = job.pids_on("127.0.0.4");
    assert_eq!(noticed.len(), 1, "{:?}", job.workers());
    signal(noticed[0], Signal::SIGTERM);
    let at_two = job.wait_step(1, 2);
    // Rank 0 reports the engine's lateness with its progress, about once a second.
    let lateness_by = at_two.v["step"].as_u64().unwrap_or(0) + 150;
    job.wait_step(lateness_by, 2);
    let dir = scratch("py-status-page-browser");
    let url = format!("http://127.0.0.1:{port}/");
    let dom = browser::dom(&dir, &url);
    let png = target_dir().join("status-page.png");
    browser::screenshot(&dir, &url, &png, 1280, 1100);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 1500), 2);

    let has = |what: &str| assert!(dom.contains(what), "the page lacks {what:?}:\n{dom}");
    has(r#"<b id="phase" class="phase-Running">Running</b>"#);
    has(r#"<b id="generation">3</b>"#);
    has(r#"<b id="resets-count">2</b>"#);
    // The chart: a step line through three rounds.
    has(r#"<path id="size-line""#);
    assert_eq!(dom.matches(r#"class="round-mark"#).count(), 3, "{dom}");
    // Each reset with its cause and host.
    for (kind, host) in [("failure", "127.0.0.3"), ("notice", "127.0.0.4")] {
        let row = dom
            .split("<tr ")
            .find(|r| r.contains(&format!(r#"data-kind="{kind}""#)))
            .unwrap_or_else(|| panic!("no {kind} row:\n{dom}"));
        assert!(row.contains(&format!("<td>{host}</td>")), "{row}");
    }
    assert!(dom.contains("sigterm notice, deadline in 30 s"), "{dom}");
    // Every rank of the round of two, with its lateness.
    for rank in 0..2 {
        has(&format!(r#"data-rank="{rank}""#));
    }
    has(r#"data-host="127.0.0.3" data-why="blacklisted""#);
    has(r#"data-host="127.0.0.4" data-why="notice""#);
    // The driver's log, its recent lines.
    let log = dom
        .split(r#"<pre id="log">"#)
        .nth(1)
        .and_then(|l| l.split("</pre>").next())
        .unwrap_or_default();
    assert!(log.contains("host gave notice"), "{log}");
    assert!(log.contains("worker failed"), "{log}");
    let shot = std::fs::read(&png).expect("the screenshot");
    assert!(shot.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(
        shot.len() > 30_000,
        "a {} byte screenshot of a page this full",
        shot.len()
    );
    eprintln!("status page screenshot: {}", png.display());
}
