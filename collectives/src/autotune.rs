//! Autotune: the engine's knobs tuned on the running job (Horovod's `--autotune`).
//!
//! Rank 0's engine scores every setting by the bytes its ops move per microsecond of engine
//! time (from the moment an op is pending until the cycle that ran it ends), over a sample of
//! five sub-samples of `steps_per_sample` steps each (a step is each op once, as in Horovod), taking
//! the median sub-score so that a slow outlier (a fusion buffer growing, a page-fault storm)
//! does not mislead it. The first `warmup_samples` samples are discarded.
//!
//! Fusion threshold (0 to 64 MiB) and cycle time (0.5 to 100 ms; this engine's cycles are
//! cheap enough to go below Horovod's 1 ms) are tuned together by Bayesian optimisation, on
//! logarithmic scales (their effects are relative: 1 to 2 MiB matters as 32 to 64 does): a
//! Gaussian process (RBF kernel, the noise on its diagonal as regulariser,
//! solved by Cholesky) models the score, and the next setting maximises expected improvement
//! over random candidates refined by a local search. After `max_samples` samples of the two,
//! each on/off knob (hierarchical allreduce, hierarchical allgather, response cache) is tried
//! the other way round once on the best setting so far. The best setting is kept at the end.
//! A knob set explicitly is held where it was set.
//!
//! Every sample is logged at debug level and, on rank 0, as a row of the CSV file Horovod
//! writes (`HOROVOD_AUTOTUNE_LOG`); the last row holds the best setting.

use std::collections::VecDeque;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

/// The header of the autotune log, as Horovod writes it.
pub const LOG_HEADER: &str = "hierarchical_allreduce,hierarchical_allgather,torus_allreduce,\
                              cache_enabled,cycle_time_ms,tensor_fusion_threshold,score";

/// Sub-samples per sample; the sample's score is their median (as Horovod).
const SUB_SAMPLES: usize = 5;

/// Bounds of the fusion threshold, in MiB, and of the cycle time, in ms.
const FUSION_MB: (f64, f64) = (0.0, 64.0);
const CYCLE_MS: (f64, f64) = (0.5, 100.0);

/// The optimiser's coordinate of a fusion threshold (log₂ of 1 + MiB, so 0 stays in range).
fn fusion_axis(mb: f64) -> f64 {
    (1.0 + mb.max(0.0)).log2()
}

/// The optimiser's coordinate of a cycle time (ln of ms).
fn cycle_axis(ms: f64) -> f64 {
    ms.max(1e-3).ln()
}

/// The settings tried after the first, as (fusion MiB, cycle ms): a spread over the space
/// before the Gaussian process has anything to go on (Horovod's).
const TEST_POINTS: [(f64, f64); 4] = [(4.0, 5.0), (32.0, 50.0), (16.0, 25.0), (8.0, 10.0)];

/// One setting of the knobs autotune turns.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Setting {
    /// Largest fusion buffer, in bytes (0: no fusion).
    pub fusion_bytes: usize,
    /// Time between cycles.
    pub cycle: Duration,
    /// Whether the response cache is on (at its configured capacity) or off.
    pub cache: bool,
    /// Whether allreduce runs hierarchically where the hosts allow it.
    pub hierarchical_allreduce: bool,
    /// Whether allgather runs hierarchically where the hosts allow it.
    pub hierarchical_allgather: bool,
}

impl Setting {
    fn fusion_mb(&self) -> f64 {
        self.fusion_bytes as f64 / f64::from(1u32 << 20)
    }

    fn cycle_ms(&self) -> f64 {
        self.cycle.as_secs_f64() * 1e3
    }

    /// The setting as a row of the log, score last.
    fn row(&self, score: f64) -> String {
        format!(
            "{},{},0,{},{},{},{}",
            u8::from(self.hierarchical_allreduce),
            u8::from(self.hierarchical_allgather),
            u8::from(self.cache),
            self.cycle_ms(),
            self.fusion_mb(),
            score
        )
    }
}

/// What autotune settled on for one shape of the world. A process keeps it across elastic
/// rounds ([`AutotuneConfig::resume`]): a round of a shape tuned before starts on its setting
/// with no tuning, and a round of a new shape tunes starting from the setting tuned last
/// rather than from the configured knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tuned {
    /// Ranks in the world it was tuned on.
    pub size: usize,
    /// Hosts that world spanned.
    pub hosts: usize,
    /// Whether that world could run its collectives hierarchically (else the hierarchical
    /// knobs of `setting` were not tuned).
    pub hierarchical: bool,
    /// The setting autotune settled on.
    pub setting: Setting,
}

impl Tuned {
    /// The shape of the world it was tuned on: ranks, hosts, whether it ran hierarchically.
    pub fn shape(&self) -> (usize, usize, bool) {
        (self.size, self.hosts, self.hierarchical)
    }
}

/// Which knobs are held where they were set (their variable was set explicitly).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// `HOROVOD_FUSION_THRESHOLD`.
    pub fusion: bool,
    /// `HOROVOD_CYCLE_TIME`.
    pub cycle: bool,
    /// `HOROVOD_CACHE_CAPACITY`.
    pub cache: bool,
    /// `HOROVOD_HIERARCHICAL_ALLREDUCE`.
    pub hierarchical_allreduce: bool,
    /// `HOROVOD_HIERARCHICAL_ALLGATHER`.
    pub hierarchical_allgather: bool,
}

impl Held {
    /// `tuned`, with the knobs held here at their `configured` values.
    pub fn hold(&self, configured: &Setting, tuned: Setting) -> Setting {
        fn pick<T>(held: bool, configured: T, tuned: T) -> T {
            if held { configured } else { tuned }
        }
        let c = configured;
        Setting {
            fusion_bytes: pick(self.fusion, c.fusion_bytes, tuned.fusion_bytes),
            cycle: pick(self.cycle, c.cycle, tuned.cycle),
            cache: pick(self.cache, c.cache, tuned.cache),
            hierarchical_allreduce: pick(
                self.hierarchical_allreduce,
                c.hierarchical_allreduce,
                tuned.hierarchical_allreduce,
            ),
            hierarchical_allgather: pick(
                self.hierarchical_allgather,
                c.hierarchical_allgather,
                tuned.hierarchical_allgather,
            ),
        }
    }
}

/// How autotune runs (Horovod's `HOROVOD_AUTOTUNE_*` variables).
#[derive(Debug, Clone, PartialEq)]
pub struct AutotuneConfig {
    /// Samples discarded before scoring starts (default 3).
    pub warmup_samples: usize,
    /// Training steps (each op once) per sub-sample; a sample is five of them (default 10).
    pub steps_per_sample: usize,
    /// Samples of the Bayesian optimisation of fusion threshold and cycle time (default 20).
    pub max_samples: usize,
    /// The Gaussian process's noise, 0 to 1, on scores scaled to unit variance (default 0.8).
    pub noise: f64,
    /// The CSV file rank 0 logs every sample to.
    pub log: Option<PathBuf>,
    /// Knobs held constant.
    pub held: Held,
    /// Seed of the optimiser's random candidates, so a run replays.
    pub seed: u64,
    /// What earlier engines of this process tuned, one per shape, most recent last (see
    /// [`Tuned`]).
    pub resume: Vec<Tuned>,
}

impl Default for AutotuneConfig {
    fn default() -> Self {
        Self {
            warmup_samples: 3,
            steps_per_sample: 10,
            max_samples: 20,
            noise: 0.8,
            log: None,
            held: Held::default(),
            seed: 0x5eed,
            resume: Vec::new(),
        }
    }
}

// === impl Rng ===

/// A small seeded generator (SplitMix64): enough for candidate points, and it replays.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

// === impl GaussianProcess ===

/// Lower-triangular Cholesky factor of the symmetric positive definite `n`×`n` matrix `a`
/// (row-major); `None` when `a` is not positive definite.
fn cholesky(a: &[f64], n: usize) -> Option<Vec<f64>> {
    let mut l = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..=i {
            let s: f64 = (0..j).map(|k| l[i * n + k] * l[j * n + k]).sum();
            if i == j {
                let d = a[i * n + i] - s;
                if d <= 0.0 || !d.is_finite() {
                    return None;
                }
                l[i * n + i] = d.sqrt();
            } else {
                l[i * n + j] = (a[i * n + j] - s) / l[j * n + j];
            }
        }
    }
    Some(l)
}

/// Solves `L x = b` for lower-triangular `l`.
fn solve_lower(l: &[f64], n: usize, b: &[f64]) -> Vec<f64> {
    let mut x = vec![0.0; n];
    for i in 0..n {
        let s: f64 = (0..i).map(|k| l[i * n + k] * x[k]).sum();
        x[i] = (b[i] - s) / l[i * n + i];
    }
    x
}

/// Solves `Lᵀ x = b` for lower-triangular `l`.
fn solve_upper_t(l: &[f64], n: usize, b: &[f64]) -> Vec<f64> {
    let mut x = vec![0.0; n];
    for i in (0..n).rev() {
        let s: f64 = (i + 1..n).map(|k| l[k * n + i] * x[k]).sum();
        x[i] = (b[i] - s) / l[i * n + i];
    }
    x
}

/// The squared-exponential (RBF) kernel of unit variance and length scale `length`.
fn rbf(a: &[f64], b: &[f64], length: f64) -> f64 {
    let d2: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    (-d2 / (2.0 * length * length)).exp()
}

/// A Gaussian process regressor with an RBF kernel of unit variance: the posterior over a
/// function given noisy observations of it.
#[derive(Debug, Clone)]
pub struct GaussianProcess {
    xs: Vec<Vec<f64>>,
    length: f64,
    /// Cholesky factor of `K + noise² I`.
    chol: Vec<f64>,
    /// `(K + noise² I)⁻¹ y`.
    weights: Vec<f64>,
    /// `yᵀ (K + noise² I)⁻¹ y`, for the likelihood.
    fit: f64,
}

impl GaussianProcess {
    /// Conditions the process on `ys` observed at `xs`, with observation noise `noise`
    /// (a standard deviation) and kernel length scale `length`. `None` for no points, points of
    /// different dimensions, or a kernel matrix that is not positive definite.
    pub fn fit(xs: &[Vec<f64>], ys: &[f64], length: f64, noise: f64) -> Option<Self> {
        let n = xs.len();
        if n == 0 || ys.len() != n || xs.iter().any(|x| x.len() != xs[0].len()) {
            return None;
        }
        let mut k = vec![0.0; n * n];
        for i in 0..n {
            for j in 0..n {
                k[i * n + j] = rbf(&xs[i], &xs[j], length);
            }
            // A little jitter keeps a noiseless fit of repeated points solvable.
            k[i * n + i] += noise * noise + 1e-10;
        }
        let chol = cholesky(&k, n)?;
        let weights = solve_upper_t(&chol, n, &solve_lower(&chol, n, ys));
        let fit = ys.iter().zip(&weights).map(|(y, w)| y * w).sum();
        Some(Self {
            xs: xs.to_vec(),
            length,
            chol,
            weights,
            fit,
        })
    }

    /// The log marginal likelihood of the observations (higher: a kernel that explains them
    /// better).
    pub fn log_likelihood(&self) -> f64 {
        let n = self.xs.len();
        let log_det: f64 = (0..n).map(|i| self.chol[i * n + i].ln()).sum();
        -0.5 * self.fit - log_det - 0.5 * n as f64 * (2.0 * std::f64::consts::PI).ln()
    }

    /// The posterior mean and standard deviation at `x`.
    pub fn predict(&self, x: &[f64]) -> (f64, f64) {
        let n = self.xs.len();
        let ks: Vec<f64> = self.xs.iter().map(|p| rbf(p, x, self.length)).collect();
        let mean = ks.iter().zip(&self.weights).map(|(k, w)| k * w).sum();
        let v = solve_lower(&self.chol, n, &ks);
        let var = 1.0 - v.iter().map(|a| a * a).sum::<f64>();
        (mean, var.max(0.0).sqrt())
    }
}

/// The complementary error function (Numerical Recipes' Chebyshev fit, relative error below
/// 1.2e-7), for the normal distribution function.
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 { r } else { 2.0 - r }
}

/// How much a point of posterior mean `mean` and deviation `sd` is expected to improve on
/// `best` by more than the margin `xi` (maximisation).
pub fn expected_improvement(mean: f64, sd: f64, best: f64, xi: f64) -> f64 {
    if sd <= 0.0 {
        return 0.0;
    }
    let imp = mean - best - xi;
    let z = imp / sd;
    let pdf = (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt();
    let cdf = 0.5 * erfc(-z / std::f64::consts::SQRT_2);
    (imp * cdf + sd * pdf).max(0.0)
}

// === impl BayesianOptimizer ===

/// Maximises an expensive, noisy function over a box by Bayesian optimisation: each next
/// point maximises the expected improvement under a Gaussian process fitted to the samples.
#[derive(Debug, Clone)]
pub struct BayesianOptimizer {
    bounds: Vec<(f64, f64)>,
    noise: f64,
    /// Exploration margin of the expected improvement (Horovod's 0.01).
    xi: f64,
    /// Samples in the unit cube, and their scores.
    xs: Vec<Vec<f64>>,
    ys: Vec<f64>,
    rng: Rng,
}

/// Length scales (in the unit cube) the fit chooses among by likelihood.
const LENGTHS: [f64; 7] = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0];

/// Random candidates of the acquisition, and how many of the best are refined locally.
const CANDIDATES: usize = 2000;
const REFINED: usize = 5;

impl BayesianOptimizer {
    /// An optimiser over the box `bounds` (one `(low, high)` per dimension) whose scores are
    /// observed with `noise` (a standard deviation, on scores scaled to unit variance).
    pub fn new(bounds: Vec<(f64, f64)>, noise: f64, seed: u64) -> Self {
        Self {
            bounds,
            noise,
            xi: 0.01,
            xs: Vec::new(),
            ys: Vec::new(),
            rng: Rng::new(seed),
        }
    }

    fn to_unit(&self, x: &[f64]) -> Vec<f64> {
        x.iter()
            .zip(&self.bounds)
            .map(|(v, (lo, hi))| {
                if hi > lo {
                    ((v - lo) / (hi - lo)).clamp(0.0, 1.0)
                } else {
                    0.0
                }
            })
            .collect()
    }

    fn unit_to_box(&self, u: &[f64]) -> Vec<f64> {
        u.iter()
            .zip(&self.bounds)
            .map(|(v, (lo, hi))| lo + v * (hi - lo))
            .collect()
    }

    /// Records that `x` scored `y`.
    pub fn add_sample(&mut self, x: &[f64], y: f64) {
        self.xs.push(self.to_unit(x));
        self.ys.push(y);
    }

    /// The best sample so far and its score.
    pub fn best(&self) -> Option<(Vec<f64>, f64)> {
        let (i, y) = self
            .ys
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))?;
        Some((self.unit_to_box(&self.xs[i]), *y))
    }

    /// The Gaussian process over the samples, scores scaled to zero mean and unit variance,
    /// with the length scale the samples make most likely.
    fn model(&self) -> Option<GaussianProcess> {
        let n = self.ys.len() as f64;
        let mean = self.ys.iter().sum::<f64>() / n;
        let var = self.ys.iter().map(|y| (y - mean) * (y - mean)).sum::<f64>() / n;
        let sd = if var > 0.0 { var.sqrt() } else { 1.0 };
        let ys: Vec<f64> = self.ys.iter().map(|y| (y - mean) / sd).collect();
        LENGTHS
            .iter()
            .filter_map(|&l| GaussianProcess::fit(&self.xs, &ys, l, self.noise))
            .max_by(|a, b| a.log_likelihood().total_cmp(&b.log_likelihood()))
    }

    /// The next point to sample: where the expected improvement is largest (a random point
    /// before there is any sample).
    pub fn next_sample(&mut self) -> Vec<f64> {
        let d = self.bounds.len();
        let Some(gp) = self.model() else {
            let u: Vec<f64> = (0..d).map(|_| self.rng.unit()).collect();
            return self.unit_to_box(&u);
        };
        // With noise, the best mean at a sample stands for the best seen (not the best score).
        let best = self
            .xs
            .iter()
            .map(|x| gp.predict(x).0)
            .fold(f64::NEG_INFINITY, f64::max);
        let ei = |u: &[f64]| {
            let (m, s) = gp.predict(u);
            expected_improvement(m, s, best, self.xi)
        };
        let mut cands: Vec<(f64, Vec<f64>)> = (0..CANDIDATES)
            .map(|_| {
                let u: Vec<f64> = (0..d).map(|_| self.rng.unit()).collect();
                (ei(&u), u)
            })
            .collect();
        cands.sort_by(|a, b| b.0.total_cmp(&a.0));
        cands.truncate(REFINED);
        // Local refinement: a compass search around each of the best candidates.
        let mut top = (f64::NEG_INFINITY, vec![0.5; d]);
        for (mut v, mut u) in cands {
            let mut step = 0.05;
            while step > 1e-4 {
                let mut moved = false;
                for k in 0..d {
                    for dir in [-1.0, 1.0] {
                        let mut w = u.clone();
                        w[k] = (w[k] + dir * step).clamp(0.0, 1.0);
                        let e = ei(&w);
                        if e > v {
                            (v, u, moved) = (e, w, true);
                        }
                    }
                }
                if !moved {
                    step /= 2.0;
                }
            }
            if v > top.0 {
                top = (v, u);
            }
        }
        self.unit_to_box(&top.1)
    }
}

// === impl Tuner ===

/// What autotune does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Discarding the first samples.
    Warmup(usize),
    /// Optimising fusion threshold and cycle time.
    Bayes,
    /// Trying the on/off knobs one by one, the rest at the best setting.
    Flags,
    /// Finished: the best setting stays.
    Done,
}

/// An on/off knob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flag {
    HierarchicalAllreduce,
    HierarchicalAllgather,
    Cache,
}

impl Flag {
    fn flip(self, s: &mut Setting) {
        match self {
            Self::HierarchicalAllreduce => s.hierarchical_allreduce = !s.hierarchical_allreduce,
            Self::HierarchicalAllgather => s.hierarchical_allgather = !s.hierarchical_allgather,
            Self::Cache => s.cache = !s.cache,
        }
    }
}

/// Rank 0's tuner: fed the steps of the engine, it proposes the setting every rank applies
/// next, and the best one once it is done.
#[derive(Debug)]
pub struct Tuner {
    cfg: AutotuneConfig,
    stage: Stage,
    current: Setting,
    best: Option<(Setting, f64)>,
    /// The continuous knobs not held: fusion, cycle.
    tune_fusion: bool,
    tune_cycle: bool,
    bayes: BayesianOptimizer,
    bayes_samples: usize,
    tests: VecDeque<(f64, f64)>,
    flags: VecDeque<Flag>,
    /// The sub-sample under way: bytes, time, cycles, how often each op name ran in it; and
    /// the finished sub-samples' scores.
    bytes: u64,
    time: Duration,
    steps: usize,
    seen: std::collections::HashMap<String, usize>,
    scores: Vec<f64>,
    /// Samples scored (warm-up excluded).
    samples: usize,
    log: Option<std::fs::File>,
}

impl Tuner {
    /// A tuner starting from `start`; `hierarchy` says whether the communicator can run its
    /// collectives hierarchically at all (if not, those knobs are held).
    pub fn new(cfg: AutotuneConfig, start: Setting, hierarchy: bool) -> Self {
        let held = cfg.held;
        let mut flags = VecDeque::new();
        if hierarchy && !held.hierarchical_allreduce {
            flags.push_back(Flag::HierarchicalAllreduce);
        }
        if hierarchy && !held.hierarchical_allgather {
            flags.push_back(Flag::HierarchicalAllgather);
        }
        if !held.cache {
            flags.push_back(Flag::Cache);
        }
        let (tune_fusion, tune_cycle) = (!held.fusion, !held.cycle);
        let mut bounds = Vec::new();
        if tune_fusion {
            bounds.push((fusion_axis(FUSION_MB.0), fusion_axis(FUSION_MB.1)));
        }
        if tune_cycle {
            bounds.push((cycle_axis(CYCLE_MS.0), cycle_axis(CYCLE_MS.1)));
        }
        let log = cfg.log.as_ref().and_then(|path| {
            // Appended to, so that the rounds of an elastic job that tune all stay in
            // it; horovodrun empties the file when the job starts, and the header is written once.
            let opened = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .and_then(|mut f| {
                    if f.metadata()?.len() == 0 {
                        writeln!(f, "{LOG_HEADER}")?;
                    }
                    Ok(f)
                });
            match opened {
                Ok(f) => Some(f),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e,
                        "cannot write the autotune log; tuning without it");
                    None
                }
            }
        });
        tracing::info!(
            "autotune: tunable params [hierarchical_allreduce,hierarchical_allgather,\
             torus_allreduce,cache_enabled,cycle_time_ms,tensor_fusion_threshold] score"
        );
        let stage = if cfg.warmup_samples > 0 {
            Stage::Warmup(cfg.warmup_samples)
        } else {
            Stage::Bayes
        };
        Self {
            bayes: BayesianOptimizer::new(bounds, cfg.noise, cfg.seed),
            stage,
            current: start,
            best: None,
            tune_fusion,
            tune_cycle,
            bayes_samples: 0,
            tests: TEST_POINTS.into_iter().collect(),
            flags,
            bytes: 0,
            time: Duration::ZERO,
            steps: 0,
            seen: std::collections::HashMap::new(),
            scores: Vec::new(),
            samples: 0,
            log,
            cfg,
        }
    }

    /// The setting being measured (the best one once done).
    pub fn setting(&self) -> Setting {
        self.current
    }

    /// Whether tuning has finished.
    pub fn is_done(&self) -> bool {
        self.stage == Stage::Done
    }

    /// The best setting and its score so far.
    pub fn best(&self) -> Option<(Setting, f64)> {
        self.best
    }

    /// Records one cycle that ran the ops `names`, moving `bytes` in `time` of engine time.
    /// As in Horovod, a training step is each op once: a sub-sample ends when an op is about
    /// to run a `steps_per_sample + 1`-th time in it (that cycle counts towards the next one),
    /// or, for programs whose op names never repeat, after `64 × steps_per_sample` cycles.
    /// Returns the setting every rank must apply next when a sample completed and the tuner
    /// moves on.
    pub fn step(
        &mut self,
        names: &[impl AsRef<str>],
        bytes: u64,
        time: Duration,
    ) -> Option<Setting> {
        if self.stage == Stage::Done {
            return None;
        }
        let per = self.cfg.steps_per_sample.max(1);
        let repeated = (names.iter()).any(|n| self.seen.get(n.as_ref()).is_some_and(|&k| k >= per));
        let ended = (repeated || self.steps >= 64 * per) && self.steps > 0;
        let next = if ended { self.close_sub_sample() } else { None };
        if next.is_some() {
            // This cycle ran under the setting being left: it scores neither.
            return next;
        }
        self.bytes += bytes;
        self.time += time;
        self.steps += 1;
        for n in names {
            match self.seen.get_mut(n.as_ref()) {
                Some(k) => *k += 1,
                None => {
                    self.seen.insert(n.as_ref().to_string(), 1);
                }
            }
        }
        next
    }

    /// Scores the sub-sample under way; after five, the sample is scored and the next setting
    /// chosen.
    fn close_sub_sample(&mut self) -> Option<Setting> {
        let micros = self.time.as_secs_f64() * 1e6;
        self.scores.push(if micros > 0.0 {
            self.bytes as f64 / micros
        } else {
            0.0
        });
        (self.bytes, self.time, self.steps) = (0, Duration::ZERO, 0);
        self.seen.clear();
        if self.scores.len() < SUB_SAMPLES {
            return None;
        }
        let mut s = std::mem::take(&mut self.scores);
        s.sort_by(f64::total_cmp);
        let score = s[SUB_SAMPLES / 2];
        self.sample(score)
    }

    /// A sample of the current setting scored `score`: log it, choose the next setting.
    fn sample(&mut self, score: f64) -> Option<Setting> {
        if let Stage::Warmup(left) = self.stage {
            tracing::debug!(remaining = left - 1, "autotune: warming up");
            self.stage = if left > 1 {
                Stage::Warmup(left - 1)
            } else {
                Stage::Bayes
            };
            return None;
        }
        self.samples += 1;
        let row = self.current.row(score);
        tracing::debug!(sample = self.samples, %row, "autotune: sample");
        self.write(&row);
        if self.best.is_none_or(|(_, b)| score > b) {
            self.best = Some((self.current, score));
        }
        let best = self.best.map_or(self.current, |(s, _)| s);
        if self.stage == Stage::Bayes {
            if self.tune_fusion || self.tune_cycle {
                let x = self.point(&self.current);
                self.bayes.add_sample(&x, score);
                self.bayes_samples += 1;
            }
            if (self.tune_fusion || self.tune_cycle) && self.bayes_samples < self.cfg.max_samples {
                let (fusion, cycle) = match self.tests.pop_front() {
                    Some(p) => p,
                    None => {
                        let x = self.bayes.next_sample();
                        let mut it = x.into_iter();
                        let f = if self.tune_fusion { it.next() } else { None };
                        let c = if self.tune_cycle { it.next() } else { None };
                        (f.map_or(0.0, |t| t.exp2() - 1.0), c.map_or(0.0, f64::exp))
                    }
                };
                self.current = self.with_point(self.current, fusion, cycle);
                return Some(self.current);
            }
            self.stage = Stage::Flags;
        }
        if let Some(flag) = self.flags.pop_front() {
            let mut next = best;
            flag.flip(&mut next);
            self.current = next;
            return Some(next);
        }
        self.stage = Stage::Done;
        self.current = best;
        let (setting, score) = self.best.unwrap_or((best, score));
        let row = setting.row(score);
        tracing::info!(%row, "autotune: best params");
        self.write(&row);
        Some(best)
    }

    /// The continuous knobs of `s` that are tuned, as a point of the optimiser.
    fn point(&self, s: &Setting) -> Vec<f64> {
        let mut x = Vec::new();
        if self.tune_fusion {
            x.push(fusion_axis(s.fusion_mb()));
        }
        if self.tune_cycle {
            x.push(cycle_axis(s.cycle_ms()));
        }
        x
    }

    /// `s` with the tuned continuous knobs at `fusion_mb` and `cycle_ms`.
    fn with_point(&self, mut s: Setting, fusion_mb: f64, cycle_ms: f64) -> Setting {
        if self.tune_fusion {
            s.fusion_bytes = (fusion_mb.clamp(FUSION_MB.0, FUSION_MB.1) * f64::from(1u32 << 20))
                .round() as usize;
        }
        if self.tune_cycle {
            s.cycle = Duration::from_secs_f64(cycle_ms.clamp(CYCLE_MS.0, CYCLE_MS.1) / 1e3);
        }
        s
    }

    fn write(&mut self, row: &str) {
        if let Some(f) = self.log.as_mut()
            && let Err(e) = writeln!(f, "{row}")
        {
            tracing::warn!(error = %e, "cannot write the autotune log; stopping it");
            self.log = None;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn cholesky_solves_a_known_system() {
        // A = [[4, 2], [2, 3]] = L Lᵀ with L = [[2, 0], [1, √2]].
        let l = cholesky(&[4.0, 2.0, 2.0, 3.0], 2).unwrap();
        assert!((l[0] - 2.0).abs() < 1e-12 && (l[2] - 1.0).abs() < 1e-12);
        assert!((l[3] - 2f64.sqrt()).abs() < 1e-12 && l[1] == 0.0);
        // A x = [8, 7] has x = [1.25, 1.5].
        let x = solve_upper_t(&l, 2, &solve_lower(&l, 2, &[8.0, 7.0]));
        assert!(
            (x[0] - 1.25).abs() < 1e-12 && (x[1] - 1.5).abs() < 1e-12,
            "{x:?}"
        );
        assert!(cholesky(&[1.0, 2.0, 2.0, 1.0], 2).is_none(), "indefinite");
    }

    #[test]
    fn the_normal_distribution_is_right() {
        assert!((erfc(0.0) - 1.0).abs() < 1e-7);
        assert!((erfc(1.0) - 0.157_299_207).abs() < 1e-7);
        assert!((erfc(-1.0) - 1.842_700_793).abs() < 1e-7);
        // Far below the best with no doubt: nothing to gain; a coin flip: sd/√(2π).
        assert_eq!(expected_improvement(-5.0, 0.0, 0.0, 0.0), 0.0);
        let e = expected_improvement(0.0, 1.0, 0.0, 0.0);
        assert!(
            (e - 1.0 / (2.0 * std::f64::consts::PI).sqrt()).abs() < 1e-6,
            "{e}"
        );
        assert!(expected_improvement(1.0, 0.1, 0.0, 0.0) > 0.99);
    }

    #[test]
    fn a_gp_with_little_noise_interpolates_its_points() {
        let xs: Vec<Vec<f64>> = (0..6).map(|i| vec![f64::from(i) / 5.0]).collect();
        let ys: Vec<f64> = xs.iter().map(|x| (6.0 * x[0]).sin()).collect();
        let gp = GaussianProcess::fit(&xs, &ys, 0.2, 1e-4).unwrap();
        for (x, y) in xs.iter().zip(&ys) {
            let (m, s) = gp.predict(x);
            assert!((m - y).abs() < 1e-3, "at {x:?}: {m} vs {y}");
            assert!(s < 1e-2, "at {x:?}: sd {s}");
        }
        // Far from every point the prior returns: mean 0, deviation 1.
        let (m, s) = gp.predict(&[5.0]);
        assert!(m.abs() < 1e-6 && (s - 1.0).abs() < 1e-6, "{m} {s}");
        // Noise makes it smooth instead: it no longer passes through the points.
        let noisy = GaussianProcess::fit(&xs, &ys, 0.2, 1.0).unwrap();
        let (m, _) = noisy.predict(&xs[1]);
        assert!((m - ys[1]).abs() > 0.1, "{m} vs {}", ys[1]);
        // The likelihood prefers the length scale the data has.
        let short = GaussianProcess::fit(&xs, &ys, 0.01, 0.01).unwrap();
        let right = GaussianProcess::fit(&xs, &ys, 0.2, 0.01).unwrap();
        assert!(right.log_likelihood() > short.log_likelihood());
    }

    #[test]
    fn expected_improvement_points_near_the_maximum_of_a_known_function() {
        // 1-D: f peaks at 0.7; samples around it, but not at it.
        let f = |x: f64| -(x - 0.7) * (x - 0.7);
        let mut bo = BayesianOptimizer::new(vec![(0.0, 1.0)], 0.01, 1);
        for x in [0.0, 0.2, 0.4, 0.6, 0.8, 1.0] {
            bo.add_sample(&[x], f(x));
        }
        let next = bo.next_sample();
        assert!((next[0] - 0.7).abs() < 0.08, "{next:?}");
        // 2-D, in a box that is not the unit square.
        let g = |x: &[f64]| -((x[0] - 30.0) / 64.0).powi(2) - ((x[1] - 20.0) / 100.0).powi(2);
        let mut bo = BayesianOptimizer::new(vec![(0.0, 64.0), (1.0, 100.0)], 0.01, 2);
        for a in [0.0, 16.0, 32.0, 48.0, 64.0] {
            for b in [1.0, 34.0, 67.0, 100.0] {
                bo.add_sample(&[a, b], g(&[a, b]));
            }
        }
        let next = bo.next_sample();
        assert!(
            (next[0] - 30.0).abs() < 8.0 && (next[1] - 20.0).abs() < 15.0,
            "{next:?}"
        );
    }

    fn optimise(seed: u64, rounds: usize) -> (Vec<f64>, f64) {
        // A quadratic bowl peaking at (0.3, 0.8), with a little deterministic noise.
        let f = |x: &[f64]| 1.0 - (x[0] - 0.3).powi(2) - (x[1] - 0.8).powi(2);
        let mut bo = BayesianOptimizer::new(vec![(0.0, 1.0), (0.0, 1.0)], 0.1, seed);
        for p in [[0.1, 0.1], [0.9, 0.5], [0.5, 0.5], [0.2, 0.3]] {
            bo.add_sample(&p, f(&p));
        }
        for _ in 0..rounds {
            let x = bo.next_sample();
            bo.add_sample(&x, f(&x));
        }
        bo.best().unwrap()
    }

    #[test]
    fn the_optimiser_finds_a_quadratic_s_optimum_and_replays() {
        let (x, y) = optimise(7, 16);
        assert!(y > 1.0 - 0.01, "best {y} at {x:?}");
        assert!(
            (x[0] - 0.3).abs() < 0.1 && (x[1] - 0.8).abs() < 0.1,
            "{x:?}"
        );
        // The same seed, the same path.
        assert_eq!(optimise(7, 5), optimise(7, 5));
    }

    fn start() -> Setting {
        Setting {
            fusion_bytes: 0,
            cycle: Duration::from_millis(100),
            cache: true,
            hierarchical_allreduce: false,
            hierarchical_allgather: false,
        }
    }

    /// A synthetic engine: bytes per µs fall with the cycle and rise with fusion up to 24 MiB.
    fn throughput(s: &Setting) -> f64 {
        let mb = s.fusion_mb();
        1000.0 / (1.0 + s.cycle_ms() / 10.0) * (1.0 - ((mb - 24.0) / 64.0).powi(2))
            + if s.cache { 10.0 } else { 0.0 }
    }

    #[test]
    fn the_tuner_goes_through_warmup_bayes_and_flags_and_keeps_the_best() {
        let dir = std::env::temp_dir().join(format!("hvd-autotune-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("log.csv");
        let cfg = AutotuneConfig {
            warmup_samples: 1,
            steps_per_sample: 2,
            max_samples: 12,
            log: Some(log.clone()),
            ..AutotuneConfig::default()
        };
        let mut t = Tuner::new(cfg, start(), false);
        let mut applied = vec![];
        for _ in 0..10_000 {
            if t.is_done() {
                break;
            }
            let s = t.setting();
            // One step moves 1 MB at the setting's throughput.
            let micros = 1e6 / throughput(&s);
            if let Some(next) = t.step(&["w"], 1_000_000, Duration::from_secs_f64(micros / 1e6)) {
                applied.push(next);
            }
        }
        assert!(t.is_done());
        // 12 Bayesian samples, then the cache tried off (no hierarchy here), then the best.
        assert_eq!(applied.len(), 11 + 1 + 1);
        let (best, score) = t.best().unwrap();
        assert_eq!(t.setting(), best);
        assert!(best.cache, "the cache helps");
        let top = throughput(&Setting {
            fusion_bytes: 24 << 20,
            cycle: Duration::from_millis(1),
            ..start()
        });
        assert!(
            score > 0.8 * top,
            "best {best:?} scores {score}, the optimum {top}"
        );
        assert!(score > 5.0 * throughput(&start()));
        let text = std::fs::read_to_string(&log).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], LOG_HEADER);
        assert_eq!(lines.len(), 1 + 13 + 1, "{text}");
        assert_eq!(*lines.last().unwrap(), best.row(score));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn held_knobs_stay_put() {
        let cfg = AutotuneConfig {
            warmup_samples: 0,
            steps_per_sample: 1,
            max_samples: 6,
            held: Held {
                cycle: true,
                cache: true,
                ..Held::default()
            },
            ..AutotuneConfig::default()
        };
        let mut t = Tuner::new(cfg, start(), true);
        let mut seen = vec![];
        while !t.is_done() {
            let s = t.setting();
            seen.push(s);
            t.step(
                &["w"],
                1_000_000,
                Duration::from_secs_f64(1.0 / throughput(&s)),
            );
        }
        assert!(seen.iter().all(|s| s.cycle == start().cycle && s.cache));
        assert!(seen.iter().any(|s| s.fusion_bytes != 0), "fusion is tuned");
        assert!(
            seen.iter().any(|s| s.hierarchical_allreduce),
            "hierarchy is tried"
        );
    }
}
