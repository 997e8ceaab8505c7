//! `hvd.keras` / `hvd.tensorflow.keras` end to end, with real Keras on TensorFlow (the test
//! virtualenv of `support::pyenv`): `python/tests/keras_api.py` under `horovodrun`, every
//! result checked in the script against a one-process reference on the union of the ranks'
//! batches (the optimizer through `model.fit` and custom loops, gradient accumulation,
//! compression, Adasum), the callbacks against Horovod's formulas, `load_model`, and the errors
//! for objects of the other Keras and XLA. On Keras 3 (`tf.keras` by default) at 1, 2 and 3
//! ranks, and on Keras 2 (`TF_USE_LEGACY_KERAS=1`, `tf_keras`) at 1 and 2.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use support::pyenv::{python, root};
use support::{scratch, signal};

/// Longest one run may take: a run of 3 ranks takes about 80 s on an idle 2-core machine,
/// and several test binaries load it at once.
const LIMIT: Duration = Duration::from_secs(900);

/// One run at a time: each rank is a TensorFlow process, and side by side they would only
/// slow each other down.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `python/tests/<script>` as `np` ranks on this host through `horovodrun`, with `env`
/// set, stopped after [`LIMIT`]; returns its exit code (None when it was stopped) and its
/// output.
fn run_ranks(np: usize, script: &str, env: &[(&str, &str)]) -> (Option<i32>, String) {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let tag: String = env.iter().map(|(_, v)| format!("-{v}")).collect();
    let dir = scratch(&format!("keras-{np}{tag}"));
    let (out, err) = (dir.join("stdout"), dir.join("stderr"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_horovodrun"))
        .args(["-np", &np.to_string(), "-H", &format!("127.0.0.1:{np}")])
        .arg(python())
        .arg(root().join("python/tests").join(script))
        .envs(env.iter().copied())
        .stdout(Stdio::from(
            std::fs::File::create(&out).expect("stdout file"),
        ))
        .stderr(Stdio::from(
            std::fs::File::create(&err).expect("stderr file"),
        ))
        .spawn()
        .expect("horovodrun");
    let deadline = Instant::now() + LIMIT;
    let code = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status.code();
        }
        if Instant::now() > deadline {
            // horovodrun stops its workers on SIGTERM.
            signal(child.id() as i32, Signal::SIGTERM);
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let text = format!(
        "{}\n{}",
        std::fs::read_to_string(&out).unwrap_or_default(),
        std::fs::read_to_string(&err).unwrap_or_default()
    );
    let _ = std::fs::remove_dir_all(&dir);
    (code, text)
}

/// Runs `keras_api.py` on each of `nps` ranks counts with `env`; every rank must report.
fn passes(nps: &[usize], env: &[(&str, &str)]) {
    for &np in nps {
        let (code, out) = run_ranks(np, "keras_api.py", env);
        assert_eq!(
            code,
            Some(0),
            "{np} ranks {env:?} (None: stopped after {LIMIT:?}):\n{out}"
        );
        for rank in 0..np {
            assert!(
                out.contains(&format!("keras ok: rank {rank} of {np}")),
                "{np} ranks {env:?}, rank {rank}:\n{out}"
            );
        }
    }
}

#[test]
fn the_keras_api_matches_its_references_on_1_2_and_3_ranks() {
    // Keras 3 whatever the caller's environment says.
    passes(&[1, 2, 3], &[("TF_USE_LEGACY_KERAS", "0")]);
}

/// `TF_USE_LEGACY_KERAS=1`, TensorFlow's switch that makes `tf.keras` Keras 2 (`tf_keras`), as
/// scripts written for Horovod run on a current TensorFlow: `hvd.tensorflow.keras` serves it,
/// and `hvd.keras` still serves Keras 3 only.
#[test]
fn the_keras_api_on_keras_2_matches_its_references_on_1_and_2_ranks() {
    passes(&[1, 2], &[("TF_USE_LEGACY_KERAS", "1")]);
}
