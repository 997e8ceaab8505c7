//! Elastic data-parallel training of a small classifier: a 2-hidden-layer MLP (ReLU, softmax
//! cross-entropy, SGD with momentum) written out by hand, on a synthetic dataset every rank
//! generates identically from `--seed`.
//!
//! ```text
//! horovodrun -np 4 --min-np 2 --host-discovery-script ./discover.sh \
//!     target/release/examples/elastic_train --epochs 5 --step-ms 5
//! ```
//!
//! Run alone (`target/release/examples/elastic_train`) it trains as a world of one.
//!
//! The data: 4 classes in 12 dimensions. Twelve unit Gaussian clusters sit on a circle in a
//! random plane and cluster `k` belongs to class `k % 4`, so each class is three clusters 120°
//! apart, which no linear classifier separates; the other 10 dimensions are noise. Neighbouring
//! clusters overlap a little: about 96% is the best any classifier can do.
//!
//! Every step, each rank computes the summed gradient of its share of the global batch (taken
//! from an [`ElasticSampler`], so a resize neither repeats nor skips a sample of the epoch) and
//! the ranks allreduce the sums together with their sample counts: the average is weighted by
//! samples, and a rank with an empty last batch still takes part. The synchronized state holds
//! the parameters, the momentum buffers and the progress; it is committed every
//! `--commit-every` batches and at each epoch's end. The learning rate follows the linear
//! scaling rule, `lr = --lr * size / initial size` (the global batch grows with the world), and
//! is rescaled by a reset callback after every membership change; within the run it decays
//! along a cosine to 0, so the final model depends little on the resizes on its way.
//!
//! Output is one JSON object a line on stdout: `reset` (rank 0, from the reset callback, with
//! the new scaled learning rate before decay), `epoch` (rank 0: loss and accuracy over the full
//! train and test sets) and, at the end, `done` on every rank. A worker the job no longer needs
//! exits 0.

use std::io::Write;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use hvd::ReduceOp;
use hvd::elastic::{ElasticSampler, Object, State, Tensors};
use serde::{Deserialize, Serialize};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// Epochs to train.
    #[arg(long, default_value_t = 5)]
    epochs: u64,
    /// Samples per rank and step.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Peak learning rate at the initial world size.
    #[arg(long, default_value_t = 0.05)]
    lr: f32,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f32,
    /// Seed of the dataset, the initial weights and the shuffles.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Commit every K batches (other batches end with a host-update check).
    #[arg(long, default_value_t = 10)]
    commit_every: u64,
    /// Sleep after each step, in milliseconds.
    #[arg(long, default_value_t = 0)]
    step_ms: u64,
}

const DIM: usize = 12;
const HIDDEN: usize = 32;
const CLASSES: usize = 4;
const CLUSTERS: usize = 12;
const RADIUS: f64 = 8.0;
const TRAIN_LEN: usize = 4096;
const TEST_LEN: usize = 1024;
/// `(outputs, inputs)` of each dense layer.
const LAYERS: [(usize, usize); 3] = [(HIDDEN, DIM), (HIDDEN, HIDDEN), (CLASSES, HIDDEN)];
/// A weight matrix and a bias per layer.
const PARAM_TENSORS: usize = 2 * LAYERS.len();

/// SplitMix64: small, seedable, and the same on every platform.
struct Rng(u64);

impl Rng {
    fn new(seed: u64, stream: u64) -> Self {
        Self(seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03))
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f64 {
        let u = 1.0 - self.uniform();
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// Samples as rows of `DIM` features, with their class.
struct Dataset {
    x: Vec<f32>,
    y: Vec<usize>,
}

impl Dataset {
    fn len(&self) -> usize {
        self.y.len()
    }

    fn row(&self, i: usize) -> &[f32] {
        &self.x[i * DIM..(i + 1) * DIM]
    }
}

/// The train and test sets of `seed`: see the module docs.
fn make_data(seed: u64) -> (Dataset, Dataset) {
    let mut rng = Rng::new(seed, 1);
    // An orthonormal pair spanning the plane of the clusters (Gram-Schmidt).
    let mut a: Vec<f64> = (0..DIM).map(|_| rng.normal()).collect();
    let norm = a.iter().map(|v| v * v).sum::<f64>().sqrt();
    a.iter_mut().for_each(|v| *v /= norm);
    let mut b: Vec<f64> = (0..DIM).map(|_| rng.normal()).collect();
    let dot: f64 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
    b.iter_mut().zip(&a).for_each(|(v, u)| *v -= dot * u);
    let norm = b.iter().map(|v| v * v).sum::<f64>().sqrt();
    b.iter_mut().for_each(|v| *v /= norm);
    let centers: Vec<Vec<f64>> = (0..CLUSTERS)
        .map(|k| {
            let t = std::f64::consts::TAU * k as f64 / CLUSTERS as f64;
            let (c, s) = (RADIUS * t.cos(), RADIUS * t.sin());
            a.iter().zip(&b).map(|(u, v)| c * u + s * v).collect()
        })
        .collect();
    // Features are scaled to about unit variance, as a real input pipeline would.
    let scale = 1.0 / (1.0 + RADIUS * RADIUS / DIM as f64).sqrt();
    let mut sample = |n: usize| {
        let mut x = Vec::with_capacity(n * DIM);
        let mut y = Vec::with_capacity(n);
        for _ in 0..n {
            let k = (rng.next_u64() % CLUSTERS as u64) as usize;
            y.push(k % CLASSES);
            x.extend(
                centers[k]
                    .iter()
                    .map(|c| ((c + rng.normal()) * scale) as f32),
            );
        }
        Dataset { x, y }
    };
    let train = sample(TRAIN_LEN);
    let test = sample(TEST_LEN);
    (train, test)
}

/// He-initialized weights and zero biases, in the order of `LAYERS`.
fn init_params(seed: u64) -> Vec<Vec<f32>> {
    let mut rng = Rng::new(seed, 2);
    let mut params = Vec::with_capacity(PARAM_TENSORS);
    for (out, inp) in LAYERS {
        let bound = (6.0 / inp as f64).sqrt();
        params.push(
            (0..out * inp)
                .map(|_| ((2.0 * rng.uniform() - 1.0) * bound) as f32)
                .collect(),
        );
        params.push(vec![0.0; out]);
    }
    params
}

/// `out = w · x + b` for a row-major `w` of `out.len()` rows.
fn dense(w: &[f32], b: &[f32], x: &[f32], out: &mut [f32]) {
    for (o, (row, bias)) in out.iter_mut().zip(w.chunks_exact(x.len()).zip(b)) {
        *o = bias + row.iter().zip(x).map(|(w, x)| w * x).sum::<f32>();
    }
}

fn relu(v: &mut [f32]) {
    v.iter_mut().for_each(|x| *x = x.max(0.0));
}

/// Softmax of `logits` in place; returns the cross-entropy against `label`.
fn softmax_xent(logits: &mut [f32], label: usize) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    logits.iter_mut().for_each(|z| *z = (*z - max).exp());
    let sum: f32 = logits.iter().sum();
    logits.iter_mut().for_each(|p| *p /= sum);
    -logits[label].max(f32::MIN_POSITIVE).ln()
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &x)| {
            if x > best.1 { (i, x) } else { best }
        })
        .0
}

/// Activations of one sample's forward pass.
#[derive(Default)]
struct Activations {
    h1: Vec<f32>,
    h2: Vec<f32>,
    probs: Vec<f32>,
}

/// Runs one sample forward; `acts.probs` ends up holding the class probabilities. Returns the
/// loss and whether the prediction is right.
fn forward(p: &[Vec<f32>], x: &[f32], label: usize, acts: &mut Activations) -> (f32, bool) {
    acts.h1.resize(HIDDEN, 0.0);
    acts.h2.resize(HIDDEN, 0.0);
    acts.probs.resize(CLASSES, 0.0);
    dense(&p[0], &p[1], x, &mut acts.h1);
    relu(&mut acts.h1);
    dense(&p[2], &p[3], &acts.h1, &mut acts.h2);
    relu(&mut acts.h2);
    dense(&p[4], &p[5], &acts.h2, &mut acts.probs);
    let right = argmax(&acts.probs) == label;
    (softmax_xent(&mut acts.probs, label), right)
}

/// Adds `dW += d ⊗ x`, `db += d`, and, when `dx` is given, `dx = Wᵀ d`.
fn dense_backward(
    w: &[f32],
    x: &[f32],
    d: &[f32],
    dw: &mut [f32],
    db: &mut [f32],
    dx: Option<&mut [f32]>,
) {
    for ((dw_row, db), &d) in dw.chunks_exact_mut(x.len()).zip(db.iter_mut()).zip(d) {
        *db += d;
        dw_row.iter_mut().zip(x).for_each(|(g, x)| *g += d * x);
    }
    if let Some(dx) = dx {
        dx.fill(0.0);
        for (row, &d) in w.chunks_exact(x.len()).zip(d) {
            dx.iter_mut().zip(row).for_each(|(g, w)| *g += d * w);
        }
    }
}

/// Adds the gradient of one sample's loss to `grads` (shaped like the parameters).
fn backward(p: &[Vec<f32>], x: &[f32], label: usize, acts: &Activations, grads: &mut [Vec<f32>]) {
    let mut d3 = acts.probs.clone();
    d3[label] -= 1.0;
    let [gw1, gb1, gw2, gb2, gw3, gb3] = grads else {
        return;
    };
    let mut d2 = vec![0.0; HIDDEN];
    dense_backward(&p[4], &acts.h2, &d3, gw3, gb3, Some(&mut d2));
    d2.iter_mut()
        .zip(&acts.h2)
        .for_each(|(d, &h)| *d *= f32::from(h > 0.0));
    let mut d1 = vec![0.0; HIDDEN];
    dense_backward(&p[2], &acts.h1, &d2, gw2, gb2, Some(&mut d1));
    d1.iter_mut()
        .zip(&acts.h1)
        .for_each(|(d, &h)| *d *= f32::from(h > 0.0));
    dense_backward(&p[0], x, &d1, gw1, gb1, None);
}

/// Mean loss and accuracy over a whole dataset.
fn evaluate(p: &[Vec<f32>], data: &Dataset) -> (f64, f64) {
    let mut acts = Activations::default();
    let (mut loss, mut right) = (0.0f64, 0usize);
    for i in 0..data.len() {
        let (l, ok) = forward(p, data.row(i), data.y[i], &mut acts);
        loss += f64::from(l);
        right += usize::from(ok);
    }
    let n = data.len().max(1) as f64;
    (loss / n, right as f64 / n)
}

/// Rounded for the JSON lines: the digits past the sixth say nothing.
fn round6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

/// Where training is; synchronized with the parameters.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Progress {
    /// The epoch being trained (equal to `--epochs` when done).
    epoch: u64,
    /// This epoch's order and how much of it all ranks processed.
    sampler: ElasticSampler,
    /// Batches done over all epochs.
    batches: u64,
    /// The world size training started with: the reference of the learning-rate scaling.
    base_size: usize,
}

impl Progress {
    /// The cosine decay factor of the learning rate: 1 at the first sample of the run, 0 after
    /// the last. It depends on samples seen, not steps, so every world size follows one curve.
    fn decay(&self, epochs: u64) -> f32 {
        let len = self.sampler.len.max(1) as f64;
        let done = (self.epoch as f64 * len + self.sampler.processed as f64) / len;
        let t = (done / epochs.max(1) as f64).min(1.0);
        (0.5 * (1.0 + (std::f64::consts::PI * t).cos())) as f32
    }
}

/// The learning rate for the current world before decay, shared with the reset callback.
#[derive(Debug)]
struct LrSchedule {
    base_lr: f32,
    base_size: usize,
    lr: f32,
}

impl LrSchedule {
    /// Linear scaling: the global batch is `size` per-rank batches.
    fn rescale(&mut self, size: usize) -> f32 {
        self.lr = self.base_lr * size as f32 / self.base_size.max(1) as f32;
        self.lr
    }
}

fn lock(schedule: &Mutex<LrSchedule>) -> MutexGuard<'_, LrSchedule> {
    // The schedule is three numbers, consistent after any panic.
    schedule.lock().unwrap_or_else(PoisonError::into_inner)
}

fn emit(v: &serde_json::Value) {
    let mut out = std::io::stdout().lock();
    // A closed stdout ends the job anyway; the line is not worth a panic.
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.commit_every == 0 || args.batch_size == 0 {
        bail!("--commit-every and --batch-size must be at least 1");
    }
    hvd::install_logging("warn")?;
    match train(&args) {
        Err(e) => match e.downcast_ref::<hvd::Error>() {
            Some(hvd::Error::Removed { reason }) => {
                eprintln!("elastic_train: removed from the job ({reason}); exiting");
                Ok(())
            }
            _ => Err(e),
        },
        ok => ok,
    }
}

fn train(args: &Args) -> anyhow::Result<()> {
    hvd::init().context("hvd::init")?;
    let (train_set, test_set) = make_data(args.seed);
    let mut tensors = init_params(args.seed);
    let momentum: Vec<Vec<f32>> = tensors.iter().map(|p| vec![0.0; p.len()]).collect();
    tensors.extend(momentum);
    let progress = Progress {
        epoch: 0,
        sampler: ElasticSampler::new(train_set.len(), args.seed),
        batches: 0,
        base_size: hvd::size()?,
    };
    let mut state = State::new((Tensors(tensors), Object(progress)));

    let schedule = Arc::new(Mutex::new(LrSchedule {
        base_lr: args.lr,
        base_size: hvd::size()?,
        lr: args.lr,
    }));
    state.register_reset_callbacks({
        let schedule = Arc::clone(&schedule);
        move |topology| {
            let lr = lock(&schedule).rescale(topology.size);
            if topology.rank == 0 {
                emit(&json!({
                    "event": "reset",
                    "rank": topology.rank,
                    "size": topology.size,
                    "lr": round6(f64::from(lr)),
                }));
            }
        }
    });

    let mut calls = 0u64;
    let result = hvd::elastic::run(&mut state, |state| {
        calls += 1;
        let (rank, size) = (hvd::rank()?, hvd::size()?);
        if calls == 1 {
            // Later calls follow a reset, whose callback has rescaled already; the first takes
            // the reference size from the synchronized state (a late joiner's own is wrong).
            let mut s = lock(&schedule);
            s.base_size = state.1.base_size;
            s.rescale(size);
        }
        let mut grads: Vec<Vec<f32>> = state.0[..PARAM_TENSORS]
            .iter()
            .map(|p| vec![0.0; p.len()])
            .collect();
        let mut acts = Activations::default();
        while state.1.epoch < args.epochs {
            while !state.1.sampler.epoch_done() {
                let (tensors, progress) = &mut **state;
                let (params, velocity) = tensors.split_at_mut(PARAM_TENSORS);
                grads.iter_mut().for_each(|g| g.fill(0.0));
                let mut samples = [0.0f32];
                for i in progress.sampler.batch(rank, size, args.batch_size) {
                    let (x, y) = (train_set.row(i), train_set.y[i]);
                    forward(params, x, y, &mut acts);
                    backward(params, x, y, &acts, &mut grads);
                    samples[0] += 1.0;
                }
                // Sums of gradients and of sample counts: a rank with an empty batch adds 0.
                let mut bufs: Vec<&mut [f32]> = grads
                    .iter_mut()
                    .map(Vec::as_mut_slice)
                    .chain([&mut samples[..]])
                    .collect();
                hvd::grouped_allreduce(&mut bufs, ReduceOp::Sum)?;
                // Rank 0 has a sample whenever the epoch has one left; the max only guards.
                let n = samples[0].max(1.0);
                let lr = lock(&schedule).lr * progress.decay(args.epochs);
                for ((p, v), g) in params.iter_mut().zip(velocity.iter_mut()).zip(&grads) {
                    for ((p, v), g) in p.iter_mut().zip(v.iter_mut()).zip(g) {
                        *v = args.momentum * *v + g / n;
                        *p -= lr * *v;
                    }
                }
                progress.sampler.record_batch(size, args.batch_size);
                progress.batches += 1;
                if progress.batches % args.commit_every == 0 {
                    state.commit()?;
                } else {
                    state.check_host_updates()?;
                }
                if args.step_ms > 0 {
                    std::thread::sleep(Duration::from_millis(args.step_ms));
                }
            }
            if rank == 0 {
                let params = &state.0[..PARAM_TENSORS];
                let (loss, train_acc) = evaluate(params, &train_set);
                let (_, test_acc) = evaluate(params, &test_set);
                emit(&json!({
                    "event": "epoch",
                    "epoch": state.1.epoch,
                    "loss": round6(loss),
                    "train_acc": round6(train_acc),
                    "test_acc": round6(test_acc),
                    "size": size,
                }));
            }
            let next = state.1.epoch + 1;
            state.1.epoch = next;
            state.1.sampler.set_epoch(next);
            state.commit()?;
        }
        Ok((rank, size))
    });
    let (rank, size) = result.context("elastic training failed")?;
    let (_, test_acc) = evaluate(&state.0[..PARAM_TENSORS], &test_set);
    emit(&json!({"event": "done", "rank": rank, "size": size, "test_acc": round6(test_acc)}));
    hvd::shutdown()?;
    Ok(())
}
