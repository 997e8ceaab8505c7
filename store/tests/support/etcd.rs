//! A real etcd for tests: Debian's `etcd-server`, installed on first use when missing (with
//! apt, as root), each instance on free loopback ports with its data in a directory of its
//! own, killed and removed when dropped. The data lives in memory (`/dev/shm`) where that
//! has room: etcd preallocates 64 MiB write-ahead log files and syncs them on every write,
//! which on a shared, busy disk costs space and makes its leader miss heartbeats.

#[path = "debian.rs"]
mod debian;
#[path = "stale.rs"]
mod stale;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The `etcd` binary, installed if missing.
pub fn etcd_binary() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| debian::installed("etcd", "etcd-server"))
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// One etcd member on free loopback ports.
pub struct Etcd {
    child: Option<Child>,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
}

/// Where etcd's data directories go: `/dev/shm` when it is a tmpfs with 1 GiB free, else the
/// temporary directory.
fn data_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let shm = Path::new("/dev/shm");
        let free_kib = Command::new("df")
            .args(["-k", "--output=fstype,avail"])
            .arg(shm)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| {
                let text = String::from_utf8_lossy(&o.stdout).into_owned();
                let mut row = text.lines().nth(1)?.split_whitespace();
                (row.next()? == "tmpfs").then_some(())?;
                row.next()?.parse::<u64>().ok()
            });
        if free_kib.is_some_and(|k| k >= 1 << 20) {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        }
    })
}

impl Etcd {
    /// Starts one and waits until it serves, its data in memory where there is room.
    pub fn start() -> Self {
        Self::start_in(data_root())
    }

    /// Starts one with its data under `root` (the disk, for figures comparable with a
    /// deployment's), and waits until it serves.
    pub fn start_in(root: &Path) -> Self {
        // Those of killed runs, once per process.
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(|| stale::sweep(root, "hvd-etcd-"));
        let dir = root.join(format!("hvd-etcd-{}-{}", std::process::id(), free_port()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("etcd's data directory");
        let mut e = Self {
            child: None,
            dir,
            client_port: free_port(),
            peer_port: free_port(),
        };
        e.resume();
        e
    }

    /// `HOST:PORT` of its client endpoint.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// A `--state-store` URL for a job under `prefix`.
    pub fn url(&self, prefix: &str) -> String {
        format!("etcd://{}/{prefix}", self.endpoint())
    }

    /// Kills it (its data stays): the store is unreachable until [`Etcd::resume`].
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it (again) on the same ports and data, and waits until it serves.
    pub fn resume(&mut self) {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let log = std::fs::File::create(self.dir.join("etcd.log")).expect("etcd's log");
        let child = Command::new(etcd_binary())
            .arg("--name=t")
            .arg(format!("--data-dir={}", self.dir.join("data").display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=t={peer}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd starts");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        let health = format!("127.0.0.1:{}", self.client_port);
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect(&health) {
                use std::io::{Read, Write};
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let _ = write!(s, "GET /health HTTP/1.0\r\n\r\n");
                let mut body = String::new();
                let _ = s.read_to_string(&mut body);
                if body.contains("\"health\":\"true\"") {
                    return;
                }
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                let log = std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default();
                panic!("etcd exited ({status}): {log}");
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not become healthy in 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
