//! A long elastic run of the background engine, for memory: every step submits a burst of
//! tensors to the engine and prints this rank's resident memory, so a run with resets every
//! half minute shows whether anything leaks across generations.
//!
//! ```text
//! horovodrun -np 4 --min-np 2 --host-discovery-script ./discover.sh \
//!     --blacklist-cooldown-range 5 5 target/release/examples/engine_soak --seconds 600
//! ```
//!
//! Each rank prints `{"event":"mem","rank":r,"size":n,"step":s,"rss_kib":k,"fusion_kib":f}`
//! every `--report-every` steps, and `{"event":"done",...}` at the end.

use std::io::Write;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use hvd::ReduceOp;
use hvd::elastic::{Object, State};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// How long to train.
    #[arg(long, default_value_t = 600.0)]
    seconds: f64,
    /// Tensors per step.
    #[arg(long, default_value_t = 50)]
    tensors: usize,
    /// f32 elements per tensor.
    #[arg(long, default_value_t = 65_536)]
    elems: usize,
    /// Print memory every this many steps.
    #[arg(long, default_value_t = 20)]
    report_every: u64,
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

fn emit(v: &serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    hvd::init().context("hvd::init")?;
    let start = Instant::now();
    let mut state = State::new(Object(0u64));
    let fusion_kib = (args.tensors * args.elems * 4 / 1024) as u64;
    let r = hvd::elastic::run(&mut state, |st| {
        let engine = hvd::start_engine(hvd::engine_config()?)?;
        let (rank, size) = (hvd::rank()?, hvd::size()?);
        loop {
            let stop = [u8::from(start.elapsed().as_secs_f64() >= args.seconds)];
            // Every rank stops at the same step.
            let stop = engine
                .allreduce_async(&format!("stop/{}", st.0), stop.to_vec(), ReduceOp::Max)
                .wait()?;
            if stop[0] == 1 {
                break;
            }
            let handles: Vec<_> = (0..args.tensors)
                .map(|k| {
                    engine.allreduce_async(
                        &format!("s{}/t{k}", st.0),
                        vec![1.0f32; args.elems],
                        ReduceOp::Sum,
                    )
                })
                .collect();
            for h in handles {
                let v = h.wait()?;
                check_sums(&v, size)?;
            }
            st.0 += 1;
            if st.0 % args.report_every == 0 {
                emit(
                    &json!({"event": "mem", "rank": rank, "size": size, "step": st.0, "rss_kib": rss_kib(), "fusion_kib": fusion_kib}),
                );
            }
            st.commit()?;
        }
        hvd::stop_engine(engine)?;
        Ok((rank, size))
    });
    let (rank, size) = match r {
        Ok(v) => v,
        Err(hvd::Error::Removed { .. }) => return Ok(()),
        Err(e) => return Err(e).context("elastic run"),
    };
    emit(
        &json!({"event": "done", "rank": rank, "size": size, "steps": state.0, "rss_kib": rss_kib()}),
    );
    hvd::shutdown()?;
    Ok(())
}

/// A wrong sum ends the run: the engine must never hand back a half-reduced tensor.
fn check_sums(v: &[f32], size: usize) -> hvd::Result<()> {
    if v.iter().any(|&x| x != size as f32) {
        eprintln!("engine_soak: a tensor came back with a wrong sum");
        std::process::exit(2);
    }
    Ok(())
}
