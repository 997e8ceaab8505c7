//! Autotune on a running engine: every rank switches to rank 0's settings at the same cycle,
//! results stay right across the switches, and rank 0 logs every sample as Horovod does.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::time::Duration;

use hvd_collectives::autotune::LOG_HEADER;
use hvd_collectives::{AutotuneConfig, Engine, EngineConfig, ReduceOp};
use support::world_on;

#[test]
fn every_rank_ends_on_rank_0_s_best_setting_with_every_sum_right() {
    let dir = std::env::temp_dir().join(format!("hvd-autotune-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("autotune.csv");
    // Two "hosts" of two ranks: the hierarchical knobs can be tuned too.
    let ips = ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"];
    let out = world_on(
        &ips,
        |_| {},
        |comm| {
            let r = comm.rank();
            let hierarchy = comm.can_run_hierarchically();
            let comm = std::mem::replace(comm, hvd_collectives::Communicator::single());
            let cfg = EngineConfig {
                fusion_bytes: 0,
                cycle: Duration::from_millis(20),
                autotune: Some(AutotuneConfig {
                    warmup_samples: 1,
                    steps_per_sample: 1,
                    max_samples: 3,
                    log: Some(log.clone()),
                    ..AutotuneConfig::default()
                }),
                ..EngineConfig::default()
            };
            let e = Engine::start(comm, cfg).unwrap();
            let mut bursts = 0;
            let mut settings = Vec::new();
            loop {
                bursts += 1;
                assert!(bursts < 2000, "autotune never finished");
                // Small and large tensors (the large ones take the ring or hierarchical path),
                // and an allgather.
                let handles: Vec<_> = [10usize, 3000, 70_000, 250_000]
                    .iter()
                    .enumerate()
                    .map(|(k, &n)| {
                        let v: Vec<f64> = (0..n).map(|i| (i % 7 + r) as f64).collect();
                        e.allreduce_async(&format!("g{k}"), v, ReduceOp::Sum)
                    })
                    .collect();
                let rows = e.allgather_async("rows", vec![r as i32; 2 * (r + 1)], 2);
                for (k, h) in handles.into_iter().enumerate() {
                    let got = h.wait().unwrap();
                    for (i, x) in got.iter().enumerate() {
                        let want = (4 * (i % 7) + 6) as f64;
                        assert_eq!(*x, want, "burst {bursts}, tensor {k}, element {i}");
                    }
                }
                let want: Vec<i32> = (0..4i32)
                    .flat_map(|q| vec![q; 2 * (q as usize + 1)])
                    .collect();
                assert_eq!(rows.wait().unwrap(), want, "burst {bursts}");
                let status = e.status();
                if settings.last() != Some(&status.setting) {
                    settings.push(status.setting);
                }
                // Stop together: once every rank has seen tuning end.
                let done = e
                    .allreduce_async(
                        &format!("done{bursts}"),
                        vec![u8::from(!status.autotuning)],
                        ReduceOp::Min,
                    )
                    .wait()
                    .unwrap();
                if done[0] == 1 {
                    break;
                }
            }
            (e.status(), settings, hierarchy)
        },
    );
    let (first, _, hierarchy) = &out[0];
    assert!(*hierarchy, "two hosts of two ranks run hierarchically");
    assert!(!first.autotuning);
    for (r, (status, settings, _)) in out.iter().enumerate() {
        assert_eq!(status.setting, first.setting, "rank {r} ended elsewhere");
        assert!(
            settings.len() > 2,
            "rank {r} saw settings switch: {settings:?}"
        );
    }
    // Warm-up discarded; then 3 Bayesian samples, each on/off knob tried once, the best.
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], LOG_HEADER);
    let flags = if *hierarchy { 3 } else { 1 };
    assert_eq!(lines.len(), 1 + 3 + flags + 1, "{text}");
    let best: Vec<&str> = lines.last().unwrap().split(',').collect();
    let s = first.setting;
    assert_eq!(
        best[0],
        if s.hierarchical_allreduce { "1" } else { "0" },
        "{text}"
    );
    assert_eq!(best[3], if s.cache { "1" } else { "0" }, "{text}");
    assert_eq!(
        best[4].parse::<f64>().unwrap(),
        s.cycle.as_secs_f64() * 1e3,
        "{text}"
    );
    let scores: Vec<f64> = lines[1..lines.len() - 1]
        .iter()
        .map(|l| l.rsplit(',').next().unwrap().parse().unwrap())
        .collect();
    let top = scores.iter().copied().fold(f64::MIN, f64::max);
    assert_eq!(best[6].parse::<f64>().unwrap(), top, "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}
