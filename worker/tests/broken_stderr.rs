//! A worker whose stderr reader is gone (its agent killed, its launcher's relay ended) logs on:
//! a log line must never end the process.

use std::io::{BufRead, Write};
use std::process::{Command, Stdio};

const CHILD: &str = "HVD_TEST_BROKEN_STDERR_CHILD";

#[test]
fn a_worker_logs_on_after_its_stderr_reader_is_gone() {
    if std::env::var_os(CHILD).is_some() {
        // The child: log as a worker does, wait for the parent to close the reading end of
        // stderr, then log past it.
        hvd::install_logging("info").expect("logging");
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).expect("go");
        for i in 0..3 {
            tracing::info!(i, "a line nobody reads");
        }
        std::process::exit(0);
    }
    let mut c = Command::new(std::env::current_exe().expect("test exe"))
        .args([
            "--exact",
            "a_worker_logs_on_after_its_stderr_reader_is_gone",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .env_remove("HOROVOD_LOG_LEVEL")
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the child");
    drop(c.stderr.take());
    let mut stdin = c.stdin.take().expect("stdin");
    writeln!(stdin, "go").expect("tell the child");
    drop(stdin);
    let status = c.wait().expect("wait");
    assert!(
        status.success(),
        "a log line on a broken stderr ended the process: {status}"
    );
}
