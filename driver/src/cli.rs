//! Command-line flags, named and meaning as in Horovod's `horovodrun`.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use hvd_discovery::kubernetes::PodSelector;

/// How workers are started (`--launcher`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LauncherKind {
    /// Local processes for 127.0.0.x, `localhost` and this host; `ssh` for the others.
    Auto,
    /// Every worker through the `hvd-agent` on its host (secret in HVD_AGENT_SECRET).
    Agent,
}

/// Where an elastic job's hosts come from (`--discovery`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DiscoveryKind {
    /// `--host-discovery-script`, run every `--discovery-interval`.
    Script,
    /// The Ready worker pods matching `--selector`, kept current by a watch on the API server.
    Kubernetes,
}

/// Launches a Horovod-compatible training program on one or more hosts.
#[derive(Debug, Parser)]
#[command(name = "horovodrun", version, about, trailing_var_arg = true)]
pub struct Args {
    /// Total number of training processes (`-np`).
    #[arg(long = "num-proc", value_name = "N")]
    pub np: Option<usize>,

    /// Hosts and slots: `host1:2,host2:4` (a bare host has one slot).
    #[arg(short = 'H', long = "hosts", value_name = "HOSTS")]
    pub hosts: Option<String>,

    /// File of hosts: `host slots=N` a line, `#` comments.
    #[arg(long = "hostfile", value_name = "FILE", conflicts_with = "hosts")]
    pub hostfile: Option<PathBuf>,

    /// SSH port of the remote hosts.
    #[arg(short = 'p', long = "ssh-port", value_name = "PORT")]
    pub ssh_port: Option<u16>,

    /// SSH identity (private key) file for the remote hosts.
    #[arg(short = 'i', long = "ssh-identity-file", value_name = "FILE")]
    pub ssh_identity_file: Option<PathBuf>,

    /// Also write each rank's output to DIR/rank.N/{stdout,stderr}.
    #[arg(long = "output-filename", value_name = "DIR")]
    pub output_filename: Option<PathBuf>,

    /// Log the driver's decisions in detail.
    #[arg(short = 'v', long = "verbose")]
    pub verbose: bool,

    /// Seconds to wait for every worker to start and register (env HOROVOD_START_TIMEOUT).
    #[arg(long = "start-timeout", value_name = "SECS")]
    pub start_timeout: Option<f64>,

    /// Network interface whose address the workers use for their connections.
    #[arg(long = "network-interface", value_name = "IFACE")]
    pub network_interface: Option<String>,

    /// Elastic: fewest workers training continues with (defaults to -np). Turns elastic mode on.
    #[arg(long = "min-np", alias = "min-num-proc", value_name = "N")]
    pub min_np: Option<usize>,

    /// Elastic: most workers started (defaults to -np).
    #[arg(long = "max-np", alias = "max-num-proc", value_name = "N")]
    pub max_np: Option<usize>,

    /// Elastic: a script printing the available hosts, one `host[:slots]` a line. Turns
    /// elastic mode on.
    #[arg(long = "host-discovery-script", value_name = "SCRIPT", conflicts_with_all = ["hosts", "hostfile"])]
    pub discovery_script: Option<String>,

    /// Elastic: slots of a host the discovery script prints without `:slots`.
    #[arg(long = "slots", alias = "slots-per-host", value_name = "S")]
    pub slots: Option<usize>,

    /// Elastic: a failed host comes back after LO seconds, doubling with each failure up to HI
    /// (plus jitter). Without it, failed hosts are blacklisted for good.
    #[arg(long = "blacklist-cooldown-range", num_args = 2, value_names = ["LO", "HI"])]
    pub cooldown_range: Option<Vec<f64>>,

    /// Elastic: seconds to wait for enough slots (env HOROVOD_ELASTIC_TIMEOUT, default 600).
    #[arg(long = "elastic-timeout", value_name = "SECS")]
    pub elastic_timeout: Option<f64>,

    /// Seconds a worker may answer nothing, not even the driver's pings, before it is declared
    /// frozen (stopped, a paused VM, stuck in the kernel), killed, and its host handled as
    /// failed; a worker busy in a long step still answers (env HVD_HEARTBEAT_TIMEOUT, default
    /// 10). In a static job a frozen worker fails the job.
    #[arg(long = "heartbeat-timeout", value_name = "SECS")]
    pub heartbeat_timeout: Option<f64>,

    /// Elastic: more resets than this fail the job (default unlimited).
    #[arg(long = "reset-limit", value_name = "K")]
    pub reset_limit: Option<usize>,

    /// Elastic: seconds between discovery script runs.
    #[arg(
        long = "discovery-interval",
        value_name = "SECS",
        default_value_t = 1.0
    )]
    pub discovery_interval: f64,

    /// Elastic: a discovery script running longer than this is killed and counts as failed.
    #[arg(
        long = "discovery-timeout",
        value_name = "SECS",
        default_value_t = 30.0
    )]
    pub discovery_timeout: f64,

    /// Record every rank's collective engine (and elastic resets) as a Chrome trace in FILE.
    #[arg(long = "timeline-filename", value_name = "FILE")]
    pub timeline: Option<PathBuf>,

    /// Mark every engine cycle on the timeline.
    #[arg(long = "timeline-mark-cycles")]
    pub timeline_mark_cycles: bool,

    /// Milliseconds between the background engine's cycles (env HOROVOD_CYCLE_TIME).
    #[arg(long = "cycle-time-ms", value_name = "MS")]
    pub cycle_time_ms: Option<f64>,

    /// Largest fusion buffer in MiB, 0 to disable fusion (env HOROVOD_FUSION_THRESHOLD).
    #[arg(long = "fusion-threshold-mb", value_name = "MB")]
    pub fusion_threshold_mb: Option<f64>,

    /// Most ops whose negotiation each rank remembers, 0 to negotiate every op (env
    /// HOROVOD_CACHE_CAPACITY; default 1024).
    #[arg(long = "cache-capacity", value_name = "N")]
    pub cache_capacity: Option<u64>,

    /// Always use hierarchical allreduce: reduce on each host, ring across hosts, broadcast on
    /// each host. Without it, the workers choose it when a job spans hosts with several ranks each.
    #[arg(
        long = "hierarchical-allreduce",
        conflicts_with = "no_hierarchical_allreduce"
    )]
    pub hierarchical_allreduce: bool,

    /// TCP connections between each pair of ranks (1 to 15, default 1): the ring stripes its
    /// segments over them, which pays where one stream cannot fill the network (env
    /// HVD_TCP_STREAMS).
    #[arg(long = "tcp-streams", value_name = "N")]
    pub tcp_streams: Option<usize>,

    /// Never use hierarchical allreduce, even across hosts.
    #[arg(long = "no-hierarchical-allreduce")]
    pub no_hierarchical_allreduce: bool,

    /// How workers are started: `auto` (local processes for this machine, ssh otherwise) or
    /// `agent` (through the hvd-agent on every host; secret in HVD_AGENT_SECRET).
    #[arg(long = "launcher", value_enum, default_value_t = LauncherKind::Auto)]
    pub launcher: LauncherKind,

    /// Port the hvd-agents listen on (`--launcher agent`).
    #[arg(long = "agent-port", value_name = "PORT", default_value_t = hvd_agent::DEFAULT_PORT)]
    pub agent_port: u16,

    /// Elastic: serve the job's state as JSON on `GET /status` at this port (0: any free port,
    /// logged).
    #[arg(long = "status-port", value_name = "PORT")]
    pub status_port: Option<u16>,

    /// Elastic: keep the driver's state in etcd, `etcd://HOST:PORT[,HOST:PORT…]/PREFIX` (env
    /// HVD_STATE_STORE), so that a driver that dies is replaced (see --standby) and its workers
    /// train on meanwhile. Needs the job's secret in HVD_SECRET and a fixed
    /// --rendezvous-port, which every driver of the job shares.
    #[arg(long = "state-store", value_name = "URL")]
    pub state_store: Option<String>,

    /// With --state-store: wait while another driver of the job is active, and take over its
    /// workers when it goes away.
    #[arg(long = "standby")]
    pub standby: bool,

    /// With --state-store: seconds the active driver's lease lives without renewal; a standby
    /// takes over this long after the active driver stops (default 10).
    #[arg(long = "state-store-ttl", value_name = "SECS")]
    pub state_store_ttl: Option<f64>,

    /// With --state-store: seconds workers train on without a driver, reconnecting, before
    /// they give up and exit (default 60).
    #[arg(long = "driver-grace", value_name = "SECS")]
    pub driver_grace: Option<f64>,

    /// The port of the driver's rendezvous (default any free port). With --state-store it is
    /// required: a successor serves on the same one, where the workers look for it.
    #[arg(long = "rendezvous-port", value_name = "PORT")]
    pub rendezvous_port: Option<u16>,

    /// Elastic: where hosts come from: `script` (implied by --host-discovery-script) or
    /// `kubernetes` (the Ready pods matching --selector). Turns elastic mode on.
    #[arg(long = "discovery", value_enum, value_name = "SOURCE")]
    pub discovery: Option<DiscoveryKind>,

    /// Kubernetes discovery: label selector of the worker pods, e.g. `app=train,role=worker`.
    #[arg(long = "selector", value_name = "SELECTOR")]
    pub selector: Option<String>,

    /// Kubernetes discovery: namespace of the worker pods (default: this pod's, or the kube
    /// config's).
    #[arg(long = "namespace", value_name = "NS")]
    pub namespace: Option<String>,

    /// Kubernetes discovery: pod annotation giving a pod's slots (default `hvd.dev/slots`;
    /// pods without it have `--slots`, else 1).
    #[arg(long = "slots-annotation", value_name = "KEY")]
    pub slots_annotation: Option<String>,

    /// Kubernetes discovery: headless Service of the workers; hosts are then addressed as
    /// `<pod hostname>.<service>.<namespace>.svc` instead of by pod IP.
    #[arg(long = "service", value_name = "NAME")]
    pub service: Option<String>,

    /// The training program and its arguments.
    #[arg(required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

impl Args {
    /// The pods to watch for `--discovery kubernetes`; `None` for the other host sources.
    ///
    /// # Errors
    /// A missing `--selector`, a second host source, or a Kubernetes flag without
    /// `--discovery kubernetes`, each named.
    pub fn pod_selector(&self) -> Result<Option<PodSelector>, String> {
        let kube_flags = [
            ("--selector", self.selector.is_some()),
            ("--namespace", self.namespace.is_some()),
            ("--slots-annotation", self.slots_annotation.is_some()),
            ("--service", self.service.is_some()),
        ];
        match self.discovery {
            Some(DiscoveryKind::Kubernetes) => {}
            Some(DiscoveryKind::Script) if self.discovery_script.is_none() => {
                return Err("--discovery script needs --host-discovery-script".into());
            }
            _ => {
                return match kube_flags.iter().find(|(_, set)| *set) {
                    Some((flag, _)) => {
                        Err(format!("{flag} works with --discovery kubernetes only"))
                    }
                    None => Ok(None),
                };
            }
        }
        if self.discovery_script.is_some() || self.hosts.is_some() || self.hostfile.is_some() {
            return Err(
                "--discovery kubernetes takes its hosts from the API server; drop \
                 --host-discovery-script, -H and --hostfile"
                    .into(),
            );
        }
        let selector = match self.selector.as_deref().map(str::trim) {
            Some(s) if !s.is_empty() => s.to_string(),
            _ => {
                return Err(
                    "--discovery kubernetes needs --selector, the worker pods' labels \
                     (e.g. 'app=train,role=worker')"
                        .into(),
                );
            }
        };
        if self.slots == Some(0) {
            return Err("--slots must be at least 1".into());
        }
        let mut sel = PodSelector::new(selector, self.slots.unwrap_or(1));
        sel.namespace.clone_from(&self.namespace);
        sel.service.clone_from(&self.service);
        if let Some(a) = &self.slots_annotation {
            sel.slots_annotation.clone_from(a);
        }
        Ok(Some(sel))
    }
}

/// How many words follow `flag` as its values (0 for a switch or an unknown flag), from the
/// parser's own definitions, so a new flag can't be forgotten here.
fn values_of(flag: &str) -> usize {
    use clap::CommandFactory;
    let cmd = Args::command();
    let found = cmd.get_arguments().find(|a| {
        let mut longs = a.get_all_aliases().unwrap_or_default();
        longs.extend(a.get_long());
        let mut shorts = a.get_all_short_aliases().unwrap_or_default();
        shorts.extend(a.get_short());
        flag.strip_prefix("--").is_some_and(|l| longs.contains(&l))
            || (flag.len() == 2
                && flag.starts_with('-')
                && flag.chars().nth(1).is_some_and(|c| shorts.contains(&c)))
    });
    match found {
        Some(a) if a.get_action().takes_values() => {
            a.get_num_args().map_or(1, |r| r.min_values().max(1))
        }
        _ => 0,
    }
}

/// Rewrites Horovod's single-dash long flag `-np` into the form the parser knows. The rewrite
/// stops where the training command starts, so `./train -np 3` reaches the program untouched.
pub fn normalize<I: IntoIterator<Item = String>>(argv: I) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = argv.into_iter();
    out.extend(it.next());
    while let Some(a) = it.next() {
        if a == "-np" {
            out.push("--num-proc".into());
            out.extend(it.next());
        } else if let Some(v) = a.strip_prefix("-np=") {
            out.push(format!("--num-proc={v}"));
        } else if a == "--" || !a.starts_with('-') {
            out.push(a);
            break;
        } else {
            let values = values_of(&a);
            out.push(a);
            for _ in 0..values {
                out.extend(it.next());
            }
        }
    }
    out.extend(it);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every flag that takes a value is known to the rewrite, so `-np` after it is still
    /// Horovod's and the training command starts after the flag's value.
    #[test]
    fn every_value_flag_is_known_to_the_np_rewrite() {
        for f in [
            "--num-proc",
            "-H",
            "--hosts",
            "--hostfile",
            "-p",
            "-i",
            "--min-np",
            "--max-num-proc",
            "--host-discovery-script",
            "--state-store",
            "--state-store-ttl",
            "--driver-grace",
            "--rendezvous-port",
            "--agent-port",
            "--network-interface",
        ] {
            assert_eq!(values_of(f), 1, "{f}");
        }
        assert_eq!(values_of("--blacklist-cooldown-range"), 2);
        for f in ["--standby", "-v", "--verbose", "--no-such-flag"] {
            assert_eq!(values_of(f), 0, "{f}");
        }
        let argv = [
            "horovodrun",
            "--state-store-ttl",
            "30",
            "-np",
            "2",
            "train",
            "-np",
            "9",
        ];
        assert_eq!(
            normalize(argv.map(String::from)),
            [
                "horovodrun",
                "--state-store-ttl",
                "30",
                "--num-proc",
                "2",
                "train",
                "-np",
                "9"
            ]
        );
    }

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        let argv = std::iter::once("horovodrun")
            .chain(args.iter().copied())
            .map(String::from);
        Args::try_parse_from(normalize(argv))
    }

    #[test]
    fn horovod_flags() {
        let a = parse(&[
            "-np",
            "4",
            "-H",
            "a:2,b:2",
            "-p",
            "2222",
            "--start-timeout",
            "5",
            "./train",
            "--lr",
            "0.1",
        ])
        .unwrap();
        assert_eq!(a.np, Some(4));
        assert_eq!(a.hosts.as_deref(), Some("a:2,b:2"));
        assert_eq!(a.ssh_port, Some(2222));
        assert_eq!(a.command, vec!["./train", "--lr", "0.1"]);
        assert_eq!(parse(&["-np=2", "x"]).unwrap().np, Some(2));
        let a = parse(&["-H", "a", "-np", "1", "./train", "-np", "3"]).unwrap();
        assert_eq!(a.command, vec!["./train", "-np", "3"]);
    }

    #[test]
    fn elastic_flags() {
        let a = parse(&[
            "-np",
            "2",
            "--min-np",
            "1",
            "--max-np",
            "4",
            "--host-discovery-script",
            "./d.sh",
            "--slots-per-host",
            "2",
            "--blacklist-cooldown-range",
            "1",
            "10",
            "--reset-limit",
            "3",
            "./train",
            "--steps",
            "5",
        ])
        .unwrap();
        assert_eq!(
            (a.min_np, a.max_np, a.slots, a.reset_limit),
            (Some(1), Some(4), Some(2), Some(3))
        );
        assert_eq!(a.cooldown_range, Some(vec![1.0, 10.0]));
        assert_eq!(a.heartbeat_timeout, None);
        let h = parse(&["--heartbeat-timeout", "2.5", "-np", "2", "x"]).unwrap();
        assert_eq!(h.heartbeat_timeout, Some(2.5));
        let e = parse(&["--heartbeat-timeout", "soon", "x"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--heartbeat-timeout"), "{e}");
        assert_eq!(a.discovery_script.as_deref(), Some("./d.sh"));
        assert_eq!(a.command, vec!["./train", "--steps", "5"]);
        assert!(parse(&["-H", "a", "--host-discovery-script", "d", "x"]).is_err());
    }

    #[test]
    fn launcher_and_status_flags() {
        let a = parse(&["-np", "2", "x"]).unwrap();
        assert_eq!(
            (a.launcher, a.agent_port, a.status_port),
            (LauncherKind::Auto, 7077, None)
        );
        let a = parse(&[
            "--launcher",
            "agent",
            "--agent-port",
            "9000",
            "--status-port",
            "8080",
            "-np",
            "2",
            "./train",
            "--launcher",
            "x",
        ])
        .unwrap();
        assert_eq!(
            (a.launcher, a.agent_port, a.status_port),
            (LauncherKind::Agent, 9000, Some(8080))
        );
        assert_eq!(a.command, ["./train", "--launcher", "x"]);
        let e = parse(&["--launcher", "ssh", "x"]).unwrap_err().to_string();
        assert!(
            e.contains("ssh") && e.contains("auto") && e.contains("agent"),
            "{e}"
        );
        assert!(parse(&["--agent-port", "70000", "x"]).is_err());
    }

    #[test]
    fn kubernetes_discovery_flags() {
        let a = parse(&[
            "--discovery",
            "kubernetes",
            "--selector",
            "app=train,role=worker",
            "--namespace",
            "ml",
            "--slots",
            "4",
            "--slots-annotation",
            "example.com/gpus",
            "--service",
            "workers",
            "-np",
            "2",
            "./train",
        ])
        .unwrap();
        assert_eq!(a.discovery, Some(DiscoveryKind::Kubernetes));
        let sel = a.pod_selector().unwrap().unwrap();
        assert_eq!(sel.label_selector, "app=train,role=worker");
        assert_eq!(sel.namespace.as_deref(), Some("ml"));
        assert_eq!(sel.default_slots, 4);
        assert_eq!(sel.slots_annotation, "example.com/gpus");
        assert_eq!(sel.service.as_deref(), Some("workers"));
        assert_eq!(a.command, ["./train"]);

        let a = parse(&["--discovery", "kubernetes", "--selector", "app=t", "x"]).unwrap();
        let sel = a.pod_selector().unwrap().unwrap();
        assert_eq!(
            (
                sel.namespace,
                sel.default_slots,
                sel.slots_annotation.as_str(),
                sel.service
            ),
            (
                None,
                1,
                hvd_discovery::kubernetes::DEFAULT_SLOTS_ANNOTATION,
                None
            )
        );
        // Script discovery has no selector.
        let a = parse(&["--host-discovery-script", "./d.sh", "x"]).unwrap();
        assert_eq!(a.pod_selector().unwrap(), None);
    }

    #[test]
    fn kubernetes_discovery_misuse_is_named() {
        let err = |args: &[&str]| parse(args).unwrap().pod_selector().unwrap_err();
        assert!(err(&["--discovery", "kubernetes", "x"]).contains("needs --selector"));
        assert!(
            err(&["--discovery", "kubernetes", "--selector", " ", "x"])
                .contains("needs --selector")
        );
        assert!(
            err(&[
                "--discovery",
                "kubernetes",
                "--selector",
                "a=b",
                "-H",
                "h:1",
                "x"
            ])
            .contains("-H")
        );
        assert!(
            err(&["--selector", "a=b", "-H", "h", "x"])
                .contains("--selector works with --discovery kubernetes")
        );
        assert!(err(&["--service", "s", "x"]).contains("--service works with"));
        assert!(err(&["--discovery", "script", "x"]).contains("needs --host-discovery-script"));
        assert!(parse(&["--discovery", "consul", "x"]).is_err());
    }

    #[test]
    fn unknown_flags_and_missing_command_are_errors() {
        let e = parse(&["-np", "2", "--bogus", "x"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--bogus"), "{e}");
        assert!(parse(&["-np", "2"]).is_err());
        assert!(parse(&["-H", "a", "--hostfile", "f", "x"]).is_err());
    }
}
