//! `hvd.run`, Horovod's programmatic launcher, end to end: Python calling `hvd.run(func, ...)`,
//! which starts this build's `horovodrun` (named by `HVD_HOROVODRUN`) with a worker per rank
//! running the pickled function. The cases are in `python/tests/run.py`; the MNIST example
//! (`examples/python/pytorch_mnist_run.py`) trains on small generated MNIST files.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::path::Path;
use std::process::Command;

use support::pyenv::{python, root};
use support::scratch;

/// The venv's Python running `script` (from the repository's root) with `args`, `hvd.run`
/// finding this build's `horovodrun`; returns its exit code, stdout and stderr.
fn py(script: &str, args: &[&str], cwd: &Path) -> (i32, String, String) {
    let out = Command::new(python())
        .arg(root().join(script))
        .args(args)
        .current_dir(cwd)
        .env("HVD_HOROVODRUN", env!("CARGO_BIN_EXE_horovodrun"))
        // An elastic job that cannot form fails within the test's time, not after 600 s.
        .env("HOROVOD_ELASTIC_TIMEOUT", "60")
        .output()
        .expect("python");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs case `case` of `python/tests/run.py`; it must print `run ok: <case>`. Returns stdout.
fn passes(case: &str, args: &[&str]) -> String {
    let mut argv = vec![case];
    argv.extend_from_slice(args);
    let (code, out, err) = py("python/tests/run.py", &argv, &root());
    assert!(
        code == 0 && out.contains(&format!("run ok: {case}")),
        "{case}: exit {code}\n{out}\n{err}"
    );
    out
}

#[test]
fn results_come_back_in_rank_order_with_the_workers_output_echoed() {
    let out = passes("ranks", &[]);
    // What the workers printed reaches the caller's stdout with horovodrun's rank prefixes,
    // an unended line included, and the result lines do not.
    for rank in 0..3 {
        assert!(
            out.contains(&format!("[{rank}]<stdout>:printed by rank {rank}\n")),
            "{out}"
        );
        assert!(
            out.contains(&format!("[{rank}]<stdout>:unended by rank {rank}\n")),
            "{out}"
        );
    }
    assert!(
        !out.contains("hvd.run:"),
        "a result line was echoed:\n{out}"
    );
}

#[test]
fn lambdas_closures_and_large_payloads_travel_by_cloudpickle() {
    passes("closure", &[]);
}

#[test]
fn a_function_that_allreduces_returns_its_tensor_from_every_rank() {
    passes("torch", &[]);
}

#[test]
fn an_exception_on_one_rank_is_raised_with_its_rank_and_traceback() {
    passes("raises", &[]);
}

#[test]
fn mpi_and_bad_arguments_are_refused_with_horovodruns_reasons() {
    passes("refused", &[]);
}

#[test]
fn an_elastic_run_returns_the_first_min_np_ranks_results() {
    let dir = scratch("py-run-elastic");
    std::fs::write(dir.join("hosts"), "127.0.0.2\n127.0.0.3\n").expect("hosts");
    let script = dir.join("discover.sh").display().to_string();
    passes("elastic", &[&script]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// MNIST's four files in torchvision's raw format (IDX: a magic number, big-endian sizes,
/// then bytes) under `dir/MNIST/raw`, small and learnable: each image is dark but for a
/// bright square placed by its label.
fn write_mnist(dir: &Path, train: usize, test: usize) {
    let raw = dir.join("MNIST/raw");
    std::fs::create_dir_all(&raw).expect("the MNIST directory");
    for (prefix, n) in [("train", train), ("t10k", test)] {
        let n32 = u32::try_from(n).expect("a small set");
        let mut images = [0x0803u32, n32, 28, 28]
            .iter()
            .flat_map(|v| v.to_be_bytes())
            .collect::<Vec<u8>>();
        let mut labels = [0x0801u32, n32]
            .iter()
            .flat_map(|v| v.to_be_bytes())
            .collect::<Vec<u8>>();
        for i in 0..n {
            let label = (i * 7 + n) % 10;
            labels.push(u8::try_from(label).expect("a digit"));
            let (top, left) = (4 + (label / 5) * 10, 2 + (label % 5) * 5);
            for row in 0..28 {
                for col in 0..28 {
                    let lit = (top..top + 8).contains(&row) && (left..left + 4).contains(&col);
                    images.push(if lit {
                        255
                    } else {
                        ((row * col + i) % 16) as u8
                    });
                }
            }
        }
        std::fs::write(raw.join(format!("{prefix}-images-idx3-ubyte")), images).expect("images");
        std::fs::write(raw.join(format!("{prefix}-labels-idx1-ubyte")), labels).expect("labels");
    }
}

#[test]
fn the_mnist_example_trains_through_hvd_run() {
    let dir = scratch("py-run-mnist");
    write_mnist(&dir, 512, 128);
    let data = dir.display().to_string();
    let (code, out, err) = py(
        "examples/python/pytorch_mnist_run.py",
        &["--num-proc", "2", "--epochs", "1", "--data-dir", &data],
        &dir,
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("Running training through hvd.run"), "{out}");
    assert!(
        out.contains("[0]<stdout>:Test set: Average loss: "),
        "{out}"
    );
    assert!(
        out.contains("[1]<stdout>:Train Epoch: 1 [0/256]"),
        "rank 1 trained on its half:\n{out}"
    );
    // Both ranks return the accuracy they agreed on.
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("hvd.run returned the test accuracy of each rank: "))
        .unwrap_or_else(|| panic!("no results line:\n{out}"));
    let accuracies: Vec<f64> = serde_json::from_str(line).expect("a list of numbers");
    assert_eq!(accuracies.len(), 2, "{line}");
    assert_eq!(accuracies[0], accuracies[1], "{line}");
    let _ = std::fs::remove_dir_all(&dir);
}
