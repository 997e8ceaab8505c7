//! Where each worker runs and how it is started there: a local process for this machine's
//! names and any 127.0.0.0/8 address, `ssh` for the rest.

use std::net::IpAddr;
use std::path::Path;

/// Whether `host` names this machine: `localhost`, its host name, or a loopback address.
pub fn is_local(host: &str, own_hostname: &str) -> bool {
    if host == "localhost" || host == own_hostname {
        return true;
    }
    host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The address a local worker binds to: the loopback address it was given, else 127.0.0.1.
pub fn local_bind_addr(host: &str) -> String {
    match host.parse::<IpAddr>() {
        Ok(ip) if ip.is_loopback() => ip.to_string(),
        _ => "127.0.0.1".into(),
    }
}

/// Quotes `s` for a POSIX shell.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./:=@%+,".contains(&b))
    {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The `ssh` argument list that runs `command` with `env` on `host`, in the current directory.
pub fn ssh_argv(
    host: &str,
    port: Option<u16>,
    identity: Option<&Path>,
    cwd: &Path,
    env: &[(String, String)],
    command: &[String],
) -> Vec<String> {
    let mut argv: Vec<String> = [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=no",
    ]
    .map(String::from)
    .to_vec();
    if let Some(p) = port {
        argv.extend(["-p".into(), p.to_string()]);
    }
    if let Some(i) = identity {
        argv.extend(["-i".into(), i.display().to_string()]);
    }
    argv.push(host.into());
    let mut remote = format!("cd {} && exec env", shell_quote(&cwd.display().to_string()));
    for (k, v) in env {
        remote.push(' ');
        remote.push_str(&shell_quote(&format!("{k}={v}")));
    }
    for c in command {
        remote.push(' ');
        remote.push_str(&shell_quote(c));
    }
    argv.push(remote);
    argv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_hosts() {
        for h in [
            "localhost",
            "127.0.0.1",
            "127.0.0.3",
            "127.9.9.9",
            "::1",
            "me",
        ] {
            assert!(is_local(h, "me"), "{h}");
        }
        for h in ["10.0.0.1", "node1", "128.0.0.1"] {
            assert!(!is_local(h, "me"), "{h}");
        }
        assert_eq!(local_bind_addr("127.0.0.3"), "127.0.0.3");
        assert_eq!(local_bind_addr("localhost"), "127.0.0.1");
    }

    #[test]
    fn ssh_command_quotes_everything() {
        let argv = ssh_argv(
            "node1",
            Some(2222),
            None,
            Path::new("/work/my dir"),
            &[("HOROVOD_RANK".into(), "3".into())],
            &[
                "python".into(),
                "train.py".into(),
                "--name".into(),
                "it's".into(),
            ],
        );
        assert_eq!(
            &argv[..7],
            [
                "ssh",
                "-o",
                "BatchMode=yes",
                "-o",
                "StrictHostKeyChecking=no",
                "-p",
                "2222"
            ]
        );
        assert_eq!(argv[7], "node1");
        assert_eq!(
            argv[8],
            r"cd '/work/my dir' && exec env HOROVOD_RANK=3 python train.py --name 'it'\''s'"
        );
    }
}
