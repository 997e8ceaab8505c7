//! A small worker for checking a launch: prints its place in the job, runs a checked
//! allreduce, and can be told to fail, hang or loop, so launcher tests can exercise every exit
//! path with a real `hvd` program.
//!
//! ```text
//! horovodrun -np 4 -H 127.0.0.2:2,127.0.0.3:2 target/debug/examples/hvd_probe
//! ```

use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use hvd::ReduceOp;

#[derive(Parser)]
struct Args {
    /// Exit with this code after the allreduce (on `--on-rank` only, or on every rank).
    #[arg(long)]
    exit_code: Option<i32>,
    /// The rank that exits with `--exit-code`.
    #[arg(long)]
    on_rank: Option<usize>,
    /// Sleep forever instead of finishing (on `--hang-rank` only, or on every rank).
    #[arg(long)]
    hang: bool,
    /// The rank that hangs with `--hang`.
    #[arg(long)]
    hang_rank: Option<usize>,
    /// Keep allreducing 1 MiB buffers until a collective fails; exit 3 with the error.
    #[arg(long)]
    allreduce_loop: bool,
    /// Sleep this long before init.
    #[arg(long, default_value_t = 0)]
    delay_ms: u64,
    /// Also allreduce the ranks within a process set of the even ranks, printing the sum.
    #[arg(long)]
    process_set: bool,
    /// Train elastically for this many steps with a process set of the even ranks, allreducing
    /// ones within it every step (the set is rebuilt after every reset).
    #[arg(long)]
    elastic_set_steps: Option<u64>,
    /// Lines to print on stdout and on stderr.
    #[arg(long, default_value_t = 1)]
    lines: usize,
    /// Elements (i64) of the checked allreduce; above 4096 it takes the ring between hosts.
    #[arg(long, default_value_t = 1000)]
    elems: usize,
}

/// KiB of huge pages backing a freshly touched 8 MiB `Vec` (its mapping's `AnonHugePages`), to
/// check `hvd::malloc_huge_pages` against what the kernel did.
fn malloc_huge_kb() -> Option<u64> {
    let mut v = vec![0u8; 8 << 20];
    v.fill(1);
    let addr = std::hint::black_box(&v).as_ptr() as u64;
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        let range = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = range.split_once('-')
            && let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16))
        {
            inside = (lo..hi).contains(&addr);
            continue;
        }
        if let Some(kb) = line.strip_prefix("AnonHugePages:").filter(|_| inside) {
            return kb.trim().trim_end_matches("kB").trim().parse().ok();
        }
    }
    None
}

/// Ends the process when a process set's allreduce is wrong.
fn bail_step(rank: usize, size: usize, got: i64, want: i64) -> ! {
    eprintln!("rank {rank} of {size}: the process set summed to {got}, not {want}");
    std::process::exit(2);
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    std::thread::sleep(Duration::from_millis(args.delay_ms));
    hvd::init().context("hvd::init")?;
    let t = hvd::topology()?;
    let me = |on: Option<usize>| on.is_none_or(|r| r == t.rank);
    let hierarchical = hvd::with_communicator(|c| Ok(c.is_hierarchical()))?;
    println!(
        "{}",
        serde_json::json!({
            "event": "topology", "rank": t.rank, "size": t.size, "local_rank": t.local_rank,
            "local_size": t.local_size, "cross_rank": t.cross_rank, "cross_size": t.cross_size,
            "homogeneous": t.homogeneous, "pid": std::process::id(),
            "hierarchical": hierarchical,
            "glibc_tunables": std::env::var("GLIBC_TUNABLES").ok(),
            "thp_mem_alloc_enable": std::env::var("THP_MEM_ALLOC_ENABLE").ok(),
            "malloc_huge_pages": hvd::malloc_huge_pages(),
            "malloc_huge_kb": malloc_huge_kb(),
            "hostname": std::env::var("HOROVOD_HOSTNAME").unwrap_or_default(),
            "horovod_env": std::env::vars()
                .filter(|(k, _)| k.starts_with("HOROVOD_") || k == "NCCL_IB_DISABLE")
                .collect::<std::collections::BTreeMap<_, _>>(),
            "engine": hvd::engine_config().map(|c| format!("{c:?}")).map_err(|e| e.to_string()),
        })
    );
    for i in 0..args.lines {
        println!("out line {i} from rank {}", t.rank);
        eprintln!("err line {i} from rank {}", t.rank);
    }
    let mut v = vec![t.rank as i64 + 1; args.elems];
    hvd::allreduce(&mut v, ReduceOp::Sum)?;
    let want = (t.size * (t.size + 1) / 2) as i64;
    if v.iter().any(|&x| x != want) {
        bail!("allreduce gave {} where {want} was expected", v[0]);
    }
    if args.process_set {
        let evens: Vec<usize> = (0..t.size).step_by(2).collect();
        let set = hvd::add_process_set(&evens)?;
        let mut v = [t.rank as i64];
        match hvd::allreduce_on(&set, &mut v, ReduceOp::Sum) {
            Ok(()) => println!(
                "{}",
                serde_json::json!({"event": "process_set", "rank": t.rank, "sum": v[0]})
            ),
            Err(hvd::Error::NotInProcessSet { .. }) if t.rank % 2 == 1 => {}
            Err(e) => return Err(e).context("allreduce in the process set"),
        }
        hvd::remove_process_set(&set)?;
    }
    if let Some(steps) = args.elastic_set_steps {
        let evens: Vec<usize> = (0..t.size).step_by(2).collect();
        let set = hvd::add_process_set(&evens)?;
        let mut state = hvd::elastic::State::new(hvd::elastic::Object(0u64));
        let r = hvd::elastic::run(&mut state, |st| {
            while st.0 < steps {
                let (rank, size) = (hvd::rank()?, hvd::size()?);
                if rank % 2 == 0 {
                    let mut ones = [1i64; 4];
                    hvd::allreduce_on(&set, &mut ones, ReduceOp::Sum)?;
                    let want = size.div_ceil(2) as i64;
                    if ones[0] != want {
                        bail_step(rank, size, ones[0], want);
                    }
                    println!(
                        "{}",
                        serde_json::json!({"event": "set_step", "rank": rank, "size": size, "set_sum": ones[0]})
                    );
                }
                st.0 += 1;
                st.commit()?;
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(())
        });
        match r {
            Ok(()) | Err(hvd::Error::Removed { .. }) => {}
            Err(e) => return Err(e).context("elastic run"),
        }
    }
    if args.allreduce_loop {
        let mut buf = vec![1.0f32; 1 << 18];
        loop {
            if let Err(e) = hvd::allreduce(&mut buf, ReduceOp::Average) {
                eprintln!("collective failed: {e}");
                // Leave the launcher time to see the original failure first.
                std::thread::sleep(Duration::from_millis(500));
                std::process::exit(3);
            }
        }
    }
    if args.hang && me(args.hang_rank) {
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    if let Some(code) = args.exit_code
        && me(args.on_rank)
    {
        std::process::exit(code);
    }
    hvd::shutdown()?;
    Ok(())
}
