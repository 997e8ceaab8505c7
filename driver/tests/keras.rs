//! `hvd.keras` / `hvd.tensorflow.keras` end to end, with real Keras on TensorFlow (the test
//! virtualenv of `support::pyenv`): `python/tests/keras_api.py` under `horovodrun`, every
//! result checked in the script against a one-process reference on the union of the ranks'
//! batches (the optimizer through `model.fit` and custom loops, gradient accumulation,
//! compression, Adasum), the callbacks against Horovod's formulas, `load_model`, and the errors
//! for objects of the other Keras and XLA. On Keras 3 (`tf.keras` by default) at 1, 2 and 3
//! ranks, and on Keras 2 (`TF_USE_LEGACY_KERAS=1`, `tf_keras`) at 1 and 2.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::sync::Mutex;
use std::time::Duration;

use support::pyenv::passes_on_with;

/// Longest one run may take: a run of 3 ranks takes about 80 s on an idle 2-core machine,
/// and several test binaries load it at once.
const LIMIT: Duration = Duration::from_secs(900);

/// One run at a time: each rank is a TensorFlow process, and side by side they would only
/// slow each other down.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `keras_api.py` on each of `nps` ranks counts with `env`, one run at a time; every
/// rank must report.
fn passes(nps: &[usize], env: &[(&str, &str)]) {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    passes_on_with("keras_api.py", "keras", nps, env, LIMIT);
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
