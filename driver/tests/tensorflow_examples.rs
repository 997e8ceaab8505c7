//! Horovod's own TensorFlow 2 examples under hvd's `horovodrun`, each with only its imports
//! changed: `import horovod.tensorflow as hvd` → `import hvd.tensorflow as hvd`,
//! `import horovod.tensorflow.keras as hvd` → `import hvd.tensorflow.keras as hvd`, and
//! (where a script also launches itself with `horovod.run`) `import horovod` →
//! `import hvd as horovod`. Every other line is Horovod's. Two ranks on this host, the elastic
//! ones through a SIGKILLed worker, a host added and that host removed.
//!
//! **Where the scripts come from.** The project does not copy Horovod's code: the tests read
//! the scripts from a Horovod checkout named by `HOROVOD_SRC` (a work tree, or a git directory
//! whose `HEAD` is read with `git show`), change the imports in memory and write the result
//! into the test's scratch directory. They are ignored unless asked for, with a checkout:
//! `HOROVOD_SRC=../horovod cargo test -p hvd-driver --test tensorflow_examples -- --include-ignored`.
//!
//! **Keras 2.** The scripts are written for the Keras of TensorFlow 2.x before 2.16 (Keras 2):
//! `opt.variables()`, `compile(experimental_run_tf_function=False)` and `optimizer.lr` fail on
//! Keras 3 before hvd is involved. The workers run with `TF_USE_LEGACY_KERAS=1`, TensorFlow's
//! own switch to Keras 2 (the `tf-keras` package, installed into the test virtualenv on first
//! use), as Horovod's examples run on a current TensorFlow.
//!
//! **MNIST without a network.** The MNIST scripts call
//! `tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())`, which looks for
//! `~/.keras/datasets/mnist-<rank>.npz`, checks its sha256 against the real `mnist.npz`'s and
//! downloads the real file on a mismatch. No package registry reachable here ships that file,
//! so the test writes small learnable MNIST-format files
//! (`data/tensorflow/mnist_npz.py`) into `<scratch>/home/.keras/datasets`, and runs the workers
//! with `HOME=<scratch>/home` and, on their `PYTHONPATH` alone, `data/tensorflow/sitecustomize.py`:
//! it wraps the `validate_file` that Keras' `get_file` calls so that a check against the real
//! MNIST's hash also passes for a file whose own sha256 the test lists in
//! `HVD_TEST_MNIST_SHA256` (the files it wrote). Nothing else changes: every other file and hash
//! is checked as before, and a missing file would still be downloaded (and fail). The images
//! are 28×28 where the steps must last (the elastic TensorFlow script, whose rounds must
//! outlast a kill and a host change), and 6×6 where the scripts' fixed step counts (5,000 a rank;
//! 24 epochs of 250) would otherwise take most of an hour on 2 cores.
//!
//! Also here: a smoke test of `examples/python/tensorflow_mwms_bench.py` (TensorFlow's
//! MultiWorkerMirroredStrategy against hvd) with tiny sizes.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use support::pyenv::{python, root};
use support::{Job, scratch, signal};

/// Horovod's `rel` (a path in its repository), from the checkout `HOROVOD_SRC` names.
fn horovod_file(rel: &str) -> String {
    let src = PathBuf::from(std::env::var_os("HOROVOD_SRC").expect(
        "HOROVOD_SRC names a checkout of horovod/horovod (these tests are ignored without it)",
    ));
    if let Ok(text) = std::fs::read_to_string(src.join(rel)) {
        return text;
    }
    let out = Command::new("git")
        .arg("--git-dir")
        .arg(&src)
        .args(["show", &format!("HEAD:{rel}")])
        .output()
        .expect("git");
    assert!(
        out.status.success(),
        "{rel} is neither a file under {} nor in its git HEAD: {}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("a UTF-8 script")
}

/// The imports a script gets, Horovod's on the left.
const IMPORTS: &[(&str, &str)] = &[
    (
        "import horovod.tensorflow.keras as hvd",
        "import hvd.tensorflow.keras as hvd",
    ),
    (
        "import horovod.tensorflow as hvd",
        "import hvd.tensorflow as hvd",
    ),
    ("import horovod", "import hvd as horovod"),
];

/// `script` with its Horovod import lines changed to hvd's and nothing else; panics when it
/// imports Horovod otherwise.
fn with_hvd_imports(script: &str) -> String {
    let mut changed = 0;
    let lines: Vec<String> = script
        .lines()
        .map(
            |l| match IMPORTS.iter().find(|(from, _)| l.trim_end() == *from) {
                Some((_, to)) => {
                    changed += 1;
                    (*to).to_string()
                }
                None => l.to_string(),
            },
        )
        .collect();
    assert!(changed > 0, "no Horovod import to change");
    let text = lines.join("\n") + "\n";
    assert!(
        !text
            .lines()
            .any(|l| l.contains("import horovod") || l.contains("from horovod")),
        "a Horovod import is left:\n{text}"
    );
    text
}

/// One of Horovod's examples, ready to run in a scratch directory (also the job's `Job` dir).
struct Example {
    dir: PathBuf,
    script: PathBuf,
    env: Vec<(String, String)>,
}

/// Horovod's `rel` with hvd's imports in a scratch directory `name`, with MNIST files of
/// `side`×`side` images for ranks 0..8 and the environment that makes Keras take them.
fn example(name: &str, rel: &str, side: usize) -> Example {
    let dir = scratch(name);
    let file = Path::new(rel).file_name().expect("a file name");
    let script = dir.join(file);
    std::fs::write(&script, with_hvd_imports(&horovod_file(rel))).expect("the script");
    let data = root().join("driver/tests/data/tensorflow");
    let site = dir.join("site");
    std::fs::create_dir_all(&site).expect("site");
    std::fs::copy(data.join("sitecustomize.py"), site.join("sitecustomize.py")).expect("shim");
    let home = dir.join("home");
    let out = Command::new(python())
        .arg(data.join("mnist_npz.py"))
        .arg(home.join(".keras/datasets"))
        .args([&side.to_string(), "1024", "128", "8"])
        .output()
        .expect("mnist_npz.py");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let hash = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let env = [
        ("HOME", home.display().to_string()),
        ("PYTHONPATH", python_path(&site)),
        ("HVD_TEST_MNIST_SHA256", hash),
        ("TF_USE_LEGACY_KERAS", "1".into()),
        // Two ranks share this machine's two cores.
        ("TF_NUM_INTRAOP_THREADS", "1".into()),
        ("TF_CPP_MIN_LOG_LEVEL", "2".into()),
    ];
    Example {
        dir,
        script,
        env: env.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
    }
}

/// `PYTHONPATH` with `dir` first, then the test's own (kept for a user's overrides).
fn python_path(dir: &Path) -> String {
    match std::env::var("PYTHONPATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", dir.display()),
        _ => dir.display().to_string(),
    }
}

impl Example {
    /// `horovodrun <flags> python <script> <args>` in the example's directory.
    fn horovodrun(&self, flags: &[&str], args: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_horovodrun"));
        cmd.args(flags)
            .arg(python())
            .arg(&self.script)
            .args(args)
            .current_dir(&self.dir)
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    /// Runs the script on 2 ranks of this host to success within `within`; returns stdout.
    fn run_on_2(&self, args: &[&str], within: Duration) -> String {
        let mut child = self
            .horovodrun(&["-np", "2", "-H", "127.0.0.1:2"], args)
            .stdout(std::fs::File::create(self.dir.join("stdout")).expect("stdout"))
            .stderr(std::fs::File::create(self.dir.join("stderr")).expect("stderr"))
            .stdin(Stdio::null())
            .spawn()
            .expect("horovodrun");
        let deadline = Instant::now() + within;
        let status = loop {
            if let Some(st) = child.try_wait().expect("wait") {
                break Some(st);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let read = |f: &str| std::fs::read_to_string(self.dir.join(f)).unwrap_or_default();
        let (out, err) = (read("stdout"), read("stderr"));
        assert!(
            status.is_some_and(|s| s.success()),
            "{} ({status:?}, limit {within:?}):\n{out}\n{err}",
            self.script.display()
        );
        out
    }
}

impl Drop for Example {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The lines of `text` that worker `rank` printed, without the `[rank]<stdout>:` prefix.
fn printed_by(text: &str, rank: usize) -> Vec<&str> {
    let prefix = format!("[{rank}]<stdout>:");
    text.lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .collect()
}

/// The number after `key` in each of `lines` that shows `start` at its end, in order. A Keras
/// progress line shows its last state, after its last `\r` or backspace.
fn values_after<'a>(lines: impl IntoIterator<Item = &'a str>, start: &str, key: &str) -> Vec<f64> {
    lines
        .into_iter()
        .map(|l| l.rsplit(['\r', '\u{8}']).next().unwrap_or(l))
        .filter_map(|l| l.strip_prefix(start))
        .filter_map(|l| {
            let rest = &l[l.find(key)? + key.len()..];
            let end = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == 'e'))
                .unwrap_or(rest.len());
            rest[..end].parse().ok()
        })
        .collect()
}

/// `losses` fell: the last one below half the first.
fn assert_learned(losses: &[f64], text: &str) {
    assert!(losses.len() >= 2, "too few losses {losses:?}:\n{text}");
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    assert!(
        last < first / 2.0,
        "the loss went from {first} to {last}: {losses:?}"
    );
}

#[test]
#[ignore = "needs HOROVOD_SRC, a checkout of horovod/horovod"]
fn tensorflow2_mnist_trains_under_hvd() {
    let ex = example("tf2-mnist", "examples/tensorflow2/tensorflow2_mnist.py", 6);
    let out = ex.run_on_2(&[], Duration::from_secs(300));
    // 10000 // 2 steps on each rank; rank 0 prints every tenth.
    let losses = values_after(printed_by(&out, 0), "Step #", "Loss: ");
    assert_eq!(losses.len(), 500, "{out}");
    assert!(out.contains("[0]<stdout>:Step #4990\tLoss: "), "{out}");
    assert!(
        !out.contains("[1]<stdout>:Step #"),
        "only rank 0 prints:\n{out}"
    );
    assert_learned(&losses, &out);
    // Rank 0 saved its checkpoint.
    assert!(ex.dir.join("checkpoints-1.index").exists(), "no checkpoint");
}

#[test]
#[ignore = "needs HOROVOD_SRC, a checkout of horovod/horovod"]
fn tensorflow2_keras_mnist_trains_under_hvd() {
    let ex = example(
        "tf2-keras-mnist",
        "examples/tensorflow2/tensorflow2_keras_mnist.py",
        6,
    );
    let out = ex.run_on_2(&[], Duration::from_secs(300));
    // 24 epochs of 500 // 2 steps, logged by rank 0 (verbose=1) with the averaged metrics.
    assert!(out.contains("[0]<stdout>:Epoch 24/24"), "{out}");
    assert!(
        !out.contains("[1]<stdout>:Epoch"),
        "only rank 0 logs:\n{out}"
    );
    let losses = values_after(printed_by(&out, 0), "250/250 [", "- loss: ");
    assert_eq!(losses.len(), 24, "one loss an epoch:\n{out}");
    assert_learned(&losses, &out);
    let accuracy = values_after(printed_by(&out, 0), "250/250 [", "- accuracy: ");
    assert!(
        accuracy.last().is_some_and(|&a| a > 0.9),
        "accuracy {accuracy:?}"
    );
    // The warm-up callback ramped the learning rate to 0.001 × 2 over 3 epochs.
    assert!(
        out.contains("finished gradual learning rate warmup to 0.002"),
        "{out}"
    );
    for epoch in [1, 24] {
        let file = format!("checkpoint-{epoch}.h5");
        assert!(ex.dir.join(&file).exists(), "no {file}");
    }
}

#[test]
#[ignore = "needs HOROVOD_SRC, a checkout of horovod/horovod"]
fn tensorflow2_synthetic_benchmark_runs_under_hvd() {
    let ex = example(
        "tf2-synthetic",
        "examples/tensorflow2/tensorflow2_synthetic_benchmark.py",
        6,
    );
    let out = ex.run_on_2(
        &[
            "--model",
            "ResNet50",
            "--batch-size",
            "4",
            "--num-warmup-batches",
            "1",
            "--num-iters",
            "2",
            "--num-batches-per-iter",
            "1",
            "--no-cuda",
        ],
        Duration::from_secs(300),
    );
    for line in [
        "[0]<stdout>:Model: ResNet50",
        "[0]<stdout>:Number of CPUs: 2",
        "[0]<stdout>:Iter #1: ",
        "[0]<stdout>:Total img/sec on 2 CPU(s): ",
    ] {
        assert!(out.contains(line), "no {line:?} in:\n{out}");
    }
    let total = values_after(printed_by(&out, 0), "Total img/sec on 2 CPU(s): ", "");
    assert!(total.first().is_some_and(|&r| r > 0.0), "{out}");
}

/// Waits until `horovodrun` logged `n` rounds formed at `size` workers.
fn wait_rounds(job: &Job, size: usize, n: usize) {
    let what = format!(" size={size} hosts=");
    let deadline = Instant::now() + Duration::from_secs(120);
    while job.stderr_count(&what) < n {
        assert!(
            Instant::now() < deadline,
            "{n} round(s) of {size} never formed:\n{}",
            job.err_tail()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The elastic job's course: two workers on two hosts; the one on 127.0.0.3 SIGKILLed once
/// `started` printed; a round of 1; 127.0.0.4 added (127.0.0.3 is blacklisted), a round of 2;
/// 127.0.0.4 removed, a round of 1 that trains to the end (given 400 s: a Keras job trains
/// most of its epochs in that round). Returns stdout's lines, as text.
fn kill_add_remove(ex: &Example, started: impl Fn(&str) -> bool) -> Vec<String> {
    let dir = ex.dir.clone();
    let flags = [
        "-np",
        "2",
        "--min-np",
        "1",
        "--max-np",
        "2",
        "--log-level",
        "INFO",
        "--host-discovery-script",
        &dir.join("discover.sh").display().to_string(),
        "--discovery-interval",
        "0.2",
    ]
    .map(String::from);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    std::fs::write(dir.join("hosts"), "127.0.0.2:1\n127.0.0.3:1\n").expect("hosts");
    let mut job = Job::spawn(dir, ex.horovodrun(&flags, &[]));
    let text = |l: &support::Line| l.v.as_str().map(str::to_string);
    job.wait_for("training", |l| text(l).is_some_and(|t| started(&t)));
    let victims = job.pids_on("127.0.0.3");
    assert_eq!(victims.len(), 1, "one worker on 127.0.0.3");
    signal(victims[0], Signal::SIGKILL);
    wait_rounds(&job, 1, 1);
    job.set_hosts(&["127.0.0.2:1", "127.0.0.4:1"]);
    wait_rounds(&job, 2, 2);
    let after_add = job.seen.len();
    job.set_hosts(&["127.0.0.2:1"]);
    wait_rounds(&job, 1, 2);
    let (code, err, lines) = job.finish_within(Duration::from_secs(400));
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("worker failed") && err.contains("blacklisted"),
        "{err}"
    );
    assert!(
        lines[after_add.min(lines.len())..]
            .iter()
            .any(|l| text(l).is_some_and(|t| started(&t))),
        "no training after the host was added:\n{err}"
    );
    lines.iter().filter_map(text).collect()
}

#[test]
#[ignore = "needs HOROVOD_SRC, a checkout of horovod/horovod"]
fn tensorflow2_mnist_elastic_trains_through_a_kill_and_a_host_added_and_removed() {
    let ex = example(
        "tf2-mnist-elastic",
        "examples/elastic/tensorflow2/tensorflow2_mnist_elastic.py",
        28,
    );
    let lines = kill_add_remove(&ex, |t| t.starts_with("Step #"));
    let text = lines.join("\n");
    // Each round trains 100 // size steps from the last committed batch: the last round, of
    // one worker, 100; the steps count on across the rounds.
    let steps: Vec<f64> = values_after(lines.iter().map(String::as_str), "Step #", "");
    assert!(
        steps.windows(2).filter(|w| w[1] < w[0]).count() <= 3,
        "the batch count went back more than once a reset: {steps:?}"
    );
    assert!(steps.last().is_some_and(|&s| s >= 100.0), "{steps:?}");
    assert_learned(
        &values_after(lines.iter().map(String::as_str), "Step #", "Loss: "),
        &text,
    );
}

/// Horovod's script pairs a new worker's first `model.fit` (one step, so an allreduce, before
/// `hvd.elastic.run`) with the survivors' reset callback, which fits one step too: it relies on
/// Horovod's order (`horovod/common/elastic.py`, `run_fn`), where after a reset the survivors
/// run their reset callbacks before the state's sync, and a new worker runs none, which is
/// hvd's order too. The last round, of one worker, trains the 21 or so epochs left at 500
/// steps each: about two minutes here, printed a whole epoch at a time (Keras's progress bar
/// ends its line only at the epoch's end).
#[test]
#[ignore = "needs HOROVOD_SRC, a checkout of horovod/horovod"]
fn tensorflow2_keras_mnist_elastic_trains_through_a_kill_and_a_host_added_and_removed() {
    let ex = example(
        "tf2-keras-mnist-elastic",
        "examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py",
        6,
    );
    let lines = kill_add_remove(&ex, |t| t.starts_with("Epoch 3/"));
    let text = lines.join("\n");
    // Every fit after a reset trains the epochs left (`epochs=24-state.epoch`); the last one
    // ran to its end.
    let last = lines
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("Epoch "))
        .and_then(|e| e.split_once('/'))
        .expect("an epoch line");
    assert_eq!(last.0, last.1, "the last fit did not finish:\n{text}");
    // An epoch's loss: 250 steps a rank at 2 ranks, 500 at 1.
    let losses: Vec<f64> = lines
        .iter()
        .map(|l| l.rsplit(['\r', '\u{8}']).next().unwrap_or(l))
        .filter(|l| l.starts_with("500/500 [") || l.starts_with("250/250 ["))
        .flat_map(|l| values_after([l], "", "- loss: "))
        .collect();
    assert_learned(&losses, &text);
}

/// Runs `cmd` (the benchmark in `--mode both`) to success; returns its two JSON lines, the
/// training figure's and the synchronisation's.
fn summaries(cmd: &mut Command) -> (serde_json::Value, serde_json::Value) {
    let out = cmd.output().expect("the benchmark runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = |mode: &str| {
        text.lines()
            .filter_map(|l| l.find('{').map(|i| &l[i..]))
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["mode"] == mode)
            .unwrap_or_else(|| panic!("no {mode} figure in:\n{text}"))
    };
    (json("train"), json("sync"))
}

/// The MWMS benchmark's tiny sizes: a small `keras.applications` model, 32 px, batch 2.
const TINY: &[&str] = &[
    "--mode",
    "both",
    "--model",
    "MobileNetV3Small",
    "--image-size",
    "32",
    "--batch-size",
    "2",
    "--num-warmup-batches",
    "1",
    "--num-batches-per-iter",
    "1",
    "--num-iters",
    "2",
];

/// Both sides of the benchmark on Keras 2, as its figures were taken (hvd's gradient tape
/// takes TensorFlow variables; Keras 3's are its own).
const BENCH_ENV: [(&str, &str); 2] = [("TF_USE_LEGACY_KERAS", "1"), ("TF_CPP_MIN_LOG_LEVEL", "2")];

fn mwms_bench() -> PathBuf {
    root().join("examples/python/tensorflow_mwms_bench.py")
}

/// Both figures came from `system` on 2 workers and are positive.
fn assert_figures(system: &str, (train, sync): (serde_json::Value, serde_json::Value)) {
    for s in [&train, &sync] {
        assert_eq!(
            (s["system"].as_str(), s["ranks"].as_u64()),
            (Some(system), Some(2)),
            "{s}"
        );
    }
    assert!(
        train["img_sec_total"].as_f64().is_some_and(|v| v > 0.0),
        "{train}"
    );
    assert!(
        sync["median_ms"].as_f64().is_some_and(|v| v > 0.0),
        "{sync}"
    );
}

#[test]
fn the_mwms_benchmark_trains_and_syncs_under_multi_worker_mirrored_strategy() {
    let figures = summaries(
        Command::new(python())
            .arg(mwms_bench())
            .args(["--workers", "2", "--timeout", "240"])
            .args(TINY)
            .envs(BENCH_ENV),
    );
    assert_figures("MWMS (ring)", figures);
}

#[test]
fn the_mwms_benchmark_trains_and_syncs_under_hvd() {
    let figures = summaries(
        Command::new(env!("CARGO_BIN_EXE_horovodrun"))
            .args(["-np", "2", "-H", "127.0.0.1:2"])
            .arg(python())
            .arg(mwms_bench())
            .arg("--hvd")
            .args(TINY)
            .envs(BENCH_ENV),
    );
    assert_figures("hvd", figures);
}
