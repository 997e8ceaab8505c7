//! Autotune on a running engine: every rank switches to rank 0's settings at the same cycle,
//! results stay right across the switches, and rank 0 logs every sample as Horovod does; a
//! later engine of the process keeps what was tuned, or tunes from it on another shape.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::path::Path;
use std::time::Duration;

use hvd_collectives::autotune::LOG_HEADER;
use hvd_collectives::{AutotuneConfig, Engine, EngineConfig, ReduceOp, Setting, Tuned};
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
            let e = Engine::start(comm, tuning(&log, Vec::new())).unwrap();
            let (_, settings) = until_settled(&e, r);
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

/// An engine with fusion off and a 20 ms cycle, tuned quickly (one warm-up sample, one step
/// per sub-sample, three Bayesian samples) and logging to `log`; `resume` as
/// [`AutotuneConfig::resume`].
fn tuning(log: &Path, resume: Vec<Tuned>) -> EngineConfig {
    EngineConfig {
        fusion_bytes: 0,
        cycle: Duration::from_millis(20),
        autotune: Some(AutotuneConfig {
            warmup_samples: 1,
            steps_per_sample: 1,
            max_samples: 3,
            log: Some(log.to_path_buf()),
            resume,
            ..AutotuneConfig::default()
        }),
        ..EngineConfig::default()
    }
}

/// Runs bursts of allreduces and an allgather on `e` (this is rank `r` of 4), checking every
/// result, until every rank has seen autotune settle. Returns the bursts run and the settings
/// this rank saw, in order.
fn until_settled(e: &Engine, r: usize) -> (usize, Vec<Setting>) {
    let mut bursts = 0;
    let mut settings = Vec::new();
    loop {
        bursts += 1;
        assert!(bursts < 2000, "autotune never finished");
        // Small and large tensors (the large ones take the ring or hierarchical path), and an
        // allgather.
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
            return (bursts, settings);
        }
    }
}

/// The engine of an elastic round after the first: on a world of the shape tuned before it
/// starts on the tuned setting without tuning again (nothing logged); on another shape it
/// tunes again, starting from that setting rather than from the configured knobs.
#[test]
fn a_later_engine_keeps_what_was_tuned_or_tunes_from_it_on_another_shape() {
    let dir = std::env::temp_dir().join(format!("hvd-autotune-resume-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("autotune.csv");
    let rows = || std::fs::read_to_string(&log).unwrap().lines().count();
    let ips = ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"];
    // The later engines are configured elsewhere than the first, so that starting on the
    // tuned setting cannot be mistaken for starting on the configured one.
    let cfg = |resume: Vec<Tuned>| {
        let first = resume.is_empty();
        EngineConfig {
            fusion_bytes: if first { 0 } else { 3 << 20 },
            cycle: Duration::from_millis(if first { 20 } else { 3 }),
            ..tuning(&log, resume)
        }
    };
    let out = world_on(
        &ips,
        |_| {},
        |comm| {
            let r = comm.rank();
            let comm = std::mem::replace(comm, hvd_collectives::Communicator::single());
            let first = Engine::start(comm, cfg(Vec::new())).unwrap();
            until_settled(&first, r);
            let (comm, status) = first.stop_with_status();
            let comm = comm.unwrap();
            let tuned = status.tuned.expect("the tuned setting, once settled");
            // Every rank has seen the end of tuning: rank 0 has logged all of it.
            let logged = rows();

            // The setting of this shape wins over one tuned later for another.
            let decoy = Tuned {
                size: 8,
                setting: Setting {
                    cycle: Duration::from_millis(7),
                    ..tuned.setting
                },
                ..tuned
            };
            let same = Engine::start(comm, cfg(vec![tuned, decoy])).unwrap();
            let (same_bursts, _) = until_settled(&same, r);
            let same_status = same.status();
            let comm = same.stop().unwrap();
            let logged_same = rows();

            let other = Tuned { size: 8, ..tuned };
            let again = Engine::start(comm, cfg(vec![other])).unwrap();
            let (again_bursts, again_settings) = until_settled(&again, r);
            drop(again);
            (
                tuned,
                logged,
                same_bursts,
                same_status,
                logged_same,
                again_bursts,
                again_settings,
            )
        },
    );
    let tuned = out[0].0;
    assert_eq!(tuned.shape(), (4, 2, true));
    assert_ne!(
        (tuned.setting.fusion_bytes, tuned.setting.cycle),
        (3 << 20, Duration::from_millis(3))
    );
    for (r, (t, logged, same_bursts, same, logged_same, again_bursts, again)) in
        out.iter().enumerate()
    {
        assert_eq!(*t, tuned, "rank {r} kept another setting");
        assert_eq!(same.setting, tuned.setting, "rank {r}");
        assert_eq!(same.tuned, Some(tuned), "rank {r}");
        assert!(!same.autotuning, "rank {r}");
        assert!(
            *same_bursts <= 2,
            "rank {r}: the same shape took {same_bursts} bursts to settle"
        );
        assert_eq!(
            logged_same, logged,
            "rank {r}: the same shape logged samples"
        );
        assert_eq!(
            again.first(),
            Some(&tuned.setting),
            "rank {r}: another shape did not start from the tuned setting: {again:?}"
        );
        assert!(
            *again_bursts > 10,
            "rank {r}: another shape settled after {again_bursts} bursts, without tuning"
        );
    }
    // The first scored sample of the new shape is the tuned setting: its cycle time and
    // fusion threshold are in the first row logged after the second engine's.
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let first_again: Vec<&str> = lines[out[0].4].split(',').collect();
    assert_eq!(
        first_again[4].parse::<f64>().unwrap(),
        tuned.setting.cycle.as_secs_f64() * 1e3,
        "{text}"
    );
    assert_eq!(
        first_again[5].parse::<f64>().unwrap(),
        tuned.setting.fusion_bytes as f64 / f64::from(1u32 << 20),
        "{text}"
    );
    assert!(lines.len() > out[0].4 + 3, "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One rank's explicit "no" to hierarchical allgather holds it off: rank 0's autotune, whose
/// own variables say nothing, never tries it (every rank's wish is needed to turn it on).
#[test]
fn a_hierarchical_knob_one_rank_turned_off_is_held_off() {
    let dir = std::env::temp_dir().join(format!("hvd-autotune-held-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("autotune.csv");
    let ips = ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"];
    let out = world_on(
        &ips,
        |cfg| {
            if cfg.rank == 3 {
                cfg.hierarchical_allgather = Some(false);
            }
        },
        |comm| {
            let r = comm.rank();
            let hierarchy = comm.can_run_hierarchically();
            let comm = std::mem::replace(comm, hvd_collectives::Communicator::single());
            let e = Engine::start(comm, tuning(&log, Vec::new())).unwrap();
            let (_, settings) = until_settled(&e, r);
            (hierarchy, settings)
        },
    );
    for (r, (hierarchy, settings)) in out.iter().enumerate() {
        assert!(
            *hierarchy,
            "rank {r}: hierarchical allreduce stays possible"
        );
        assert!(
            settings.iter().all(|s| !s.hierarchical_allgather),
            "rank {r} ran allgather hierarchically: {settings:?}"
        );
    }
    // Warm-up discarded; 3 Bayesian samples; hierarchical allreduce and the cache tried
    // flipped, not allgather; the best.
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1 + 3 + 2 + 1, "{text}");
    assert!(
        lines[1..].iter().all(|l| l.split(',').nth(1) == Some("0")),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
