//! Command-line flags, named and meaning as in Horovod's `horovodrun`.

use std::path::PathBuf;

use clap::Parser;

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

    /// The training program and its arguments.
    #[arg(required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// Flags that take a value as the next word (Horovod's spellings included).
const VALUE_FLAGS: &[&str] = &[
    "-np",
    "--num-proc",
    "-H",
    "--hosts",
    "--hostfile",
    "-p",
    "--ssh-port",
    "-i",
    "--ssh-identity-file",
    "--output-filename",
    "--start-timeout",
    "--network-interface",
];

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
            let takes_value = VALUE_FLAGS.contains(&a.as_str());
            out.push(a);
            if takes_value {
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
    fn unknown_flags_and_missing_command_are_errors() {
        let e = parse(&["-np", "2", "--bogus", "x"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--bogus"), "{e}");
        assert!(parse(&["-np", "2"]).is_err());
        assert!(parse(&["-H", "a", "--hostfile", "f", "x"]).is_err());
    }
}
