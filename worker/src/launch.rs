//! What the launcher told this worker, read from the environment once, at `init`.

use std::collections::HashMap;
use std::time::Duration;

use hvd_rendezvous::{self as rv, Placement};

use crate::error::{Error, Result};

/// Where `init` reads the launcher's variables: the process environment, or a map in tests.
pub trait Env {
    /// The value of `name`, if set.
    fn var(&self, name: &str) -> Option<String>;
}

/// The real process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

impl Env for HashMap<String, String> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }
}

/// The launch parameters of one worker (its ranks through `Deref`: `launch.rank`).
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    /// The ranks the launcher gave (an elastic worker gets its own at every round).
    pub placement: Placement,
    /// This worker's host, as the launcher named it.
    pub hostname: String,
    /// The driver's rendezvous address.
    pub rendezvous: String,
    /// The job secret.
    pub secret: String,
    /// Address to bind the collective listener to, if the launcher chose one.
    pub bind_addr: Option<String>,
    /// Network interface to bind to, if the user chose one.
    pub interface: Option<String>,
    /// How long a collective may go without progress from a peer.
    pub progress_timeout: Duration,
    /// How long a collective waits for peers to arrive.
    pub arrival_timeout: Duration,
    /// How long the rendezvous may take.
    pub start_timeout: Duration,
    /// The driver's id for this worker process (the rank, in a static job).
    pub worker: u64,
    /// Whether ranks of one host may read each other's buffers (`HVD_SAME_HOST_COPY`, default on).
    pub same_host_copy: bool,
    /// Hierarchical allreduce across hosts (`HOROVOD_HIERARCHICAL_ALLREDUCE`): `1` asks for
    /// it, `0` forbids it, unset lets the communicator choose.
    pub hierarchical: Option<bool>,
    /// Hierarchical allgather across hosts (`HOROVOD_HIERARCHICAL_ALLGATHER`), as
    /// [`Launch::hierarchical`].
    pub hierarchical_allgather: Option<bool>,
    /// TCP connections to each peer (`HVD_TCP_STREAMS`, default 1).
    pub streams: usize,
    /// Whether the job is elastic (`HOROVOD_ELASTIC=1`).
    pub elastic: bool,
    /// How long a round may wait for enough hosts (`HOROVOD_ELASTIC_TIMEOUT`).
    pub elastic_timeout: Duration,
    /// With a state store (`HVD_DRIVER_GRACE`): how long this worker trains on without its
    /// driver, reconnecting, before it exits. `None`: it exits as soon as the driver is gone.
    pub driver_grace: Option<Duration>,
    /// How long this worker may take to leave gracefully after a SIGTERM before it ends at once
    /// (`HVD_NOTICE_GRACE`, default 30 s).
    pub notice_grace: Duration,
    /// The process that launched this worker (`HVD_LAUNCHER_PID`): its SIGTERM is a stop, not a
    /// notice.
    pub launcher_pid: Option<u32>,
    /// The cloud whose preemption notices this worker watches (`HVD_PREEMPTION_WATCH`).
    pub preemption_watch: Option<rv::Cloud>,
    /// Where that cloud's metadata server answers (`HVD_METADATA_ENDPOINT`).
    pub metadata_endpoint: String,
    /// How often the notice is read (`HVD_PREEMPTION_POLL`, default 2 s).
    pub preemption_poll: Duration,
    /// For tests only (`HVD_TEST_CONNECT_DELAY_MS`): the most a worker waits, a different
    /// time each round, before connecting a round's world, so that the connecting of a round
    /// spans long enough for a test to kill a member in the middle of it. Zero otherwise.
    pub connect_delay: Duration,
}

/// See [`Launch::connect_delay`].
pub(crate) const ENV_TEST_CONNECT_DELAY_MS: &str = "HVD_TEST_CONNECT_DELAY_MS";

impl std::ops::Deref for Launch {
    type Target = Placement;
    fn deref(&self) -> &Placement {
        &self.placement
    }
}

fn required(env: &dyn Env, var: &'static str) -> Result<String> {
    env.var(var).ok_or(Error::Env {
        var,
        detail: "not set (is this worker started by horovodrun?)".into(),
    })
}

fn number(env: &dyn Env, var: &'static str) -> Result<usize> {
    let v = required(env, var)?;
    v.trim().parse().map_err(|_| Error::Env {
        var,
        detail: format!("'{v}' is not a non-negative integer"),
    })
}

fn seconds(env: &dyn Env, var: &'static str, default: f64) -> Result<Duration> {
    let Some(v) = env.var(var) else {
        return Ok(Duration::from_secs_f64(default));
    };
    match v.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 => Ok(Duration::from_secs_f64(s)),
        _ => Err(Error::Env {
            var,
            detail: format!("'{v}' is not a positive number of seconds"),
        }),
    }
}

impl Launch {
    /// Reads the launch parameters; `Ok(None)` when no launcher started this process (then
    /// hvd runs as a world of one, as Horovod does without `horovodrun`).
    ///
    /// # Errors
    /// [`Error::Env`] naming a variable that is missing or malformed, including `HOROVOD_RANK`
    /// without the rendezvous address (a launcher other than hvd's `horovodrun`).
    pub fn from_env(env: &dyn Env) -> Result<Option<Self>> {
        let Some(rendezvous) = env.var(rv::ENV_RENDEZVOUS_ADDR) else {
            if env.var(rv::ENV_RANK).is_some() {
                return Err(Error::Env {
                    var: rv::ENV_RENDEZVOUS_ADDR,
                    detail: format!(
                        "not set, but {} is: this process was started by a launcher other than \
                         hvd's horovodrun",
                        rv::ENV_RANK
                    ),
                });
            }
            return Ok(None);
        };
        let elastic = env.var(rv::ENV_ELASTIC).is_some_and(|v| v.trim() == "1");
        // An elastic worker's ranks come from the driver at every round.
        let number = |var: &'static str, default: usize| {
            if elastic && env.var(var).is_none() {
                Ok(default)
            } else {
                number(env, var)
            }
        };
        let l = Self {
            placement: Placement {
                rank: number(rv::ENV_RANK, 0)?,
                size: number(rv::ENV_SIZE, 1)?,
                local_rank: number(rv::ENV_LOCAL_RANK, 0)?,
                local_size: number(rv::ENV_LOCAL_SIZE, 1)?,
                cross_rank: number(rv::ENV_CROSS_RANK, 0)?,
                cross_size: number(rv::ENV_CROSS_SIZE, 1)?,
            },
            hostname: required(env, rv::ENV_HOSTNAME)?,
            rendezvous,
            secret: required(env, rv::ENV_SECRET)?,
            bind_addr: env.var(rv::ENV_BIND_ADDR).filter(|s| !s.is_empty()),
            interface: env.var(rv::ENV_NETWORK_INTERFACE).filter(|s| !s.is_empty()),
            progress_timeout: seconds(env, rv::ENV_COLLECTIVE_TIMEOUT, 5.0)?,
            // Horovod's Gloo timeout bounds the same wait, unless hvd's own variable is set.
            arrival_timeout: match env.var(rv::ENV_ARRIVAL_TIMEOUT) {
                None => seconds(env, rv::ENV_GLOO_TIMEOUT_SECONDS, 300.0)?,
                Some(_) => seconds(env, rv::ENV_ARRIVAL_TIMEOUT, 300.0)?,
            },
            start_timeout: seconds(env, rv::ENV_START_TIMEOUT, 30.0)?,
            worker: 0,
            same_host_copy: env
                .var(rv::ENV_SAME_HOST_COPY)
                .is_none_or(|v| v.trim() != "0"),
            hierarchical: crate::switch(env, rv::ENV_HIERARCHICAL_ALLREDUCE)?,
            hierarchical_allgather: crate::switch(env, rv::ENV_HIERARCHICAL_ALLGATHER)?,
            streams: match env.var(rv::ENV_TCP_STREAMS).as_deref().map(str::trim) {
                None | Some("") => 1,
                Some(v) => match v.parse::<usize>() {
                    Ok(k) if (1..=hvd_collectives::MAX_STREAMS).contains(&k) => k,
                    _ => {
                        return Err(Error::Env {
                            var: rv::ENV_TCP_STREAMS,
                            detail: format!(
                                "'{v}' is not a number of connections from 1 to {}",
                                hvd_collectives::MAX_STREAMS
                            ),
                        });
                    }
                },
            },
            elastic,
            elastic_timeout: seconds(env, rv::ENV_ELASTIC_TIMEOUT, 600.0)?,
            driver_grace: match env.var(rv::ENV_DRIVER_GRACE) {
                None => None,
                Some(_) => Some(seconds(env, rv::ENV_DRIVER_GRACE, 60.0)?),
            },
            notice_grace: seconds(
                env,
                rv::ENV_NOTICE_GRACE,
                rv::SIGTERM_GRACE_DEFAULT.as_secs_f64(),
            )?,
            launcher_pid: match env.var(rv::ENV_LAUNCHER_PID) {
                None => None,
                Some(v) => Some(v.trim().parse().map_err(|_| Error::Env {
                    var: rv::ENV_LAUNCHER_PID,
                    detail: format!("'{v}' is not a process id"),
                })?),
            },
            preemption_watch: match env.var(rv::ENV_PREEMPTION_WATCH) {
                None => None,
                Some(v) if v.trim().is_empty() => None,
                Some(v) => Some(v.parse().map_err(|detail| Error::Env {
                    var: rv::ENV_PREEMPTION_WATCH,
                    detail,
                })?),
            },
            metadata_endpoint: env
                .var(rv::ENV_METADATA_ENDPOINT)
                .filter(|v| !v.trim().is_empty())
                .unwrap_or_else(|| crate::preemption::METADATA_DEFAULT.to_string()),
            preemption_poll: seconds(
                env,
                rv::ENV_PREEMPTION_POLL,
                crate::preemption::POLL_DEFAULT.as_secs_f64(),
            )?,
            connect_delay: match env.var(ENV_TEST_CONNECT_DELAY_MS) {
                None => Duration::ZERO,
                Some(v) => Duration::from_millis(v.trim().parse().map_err(|_| Error::Env {
                    var: ENV_TEST_CONNECT_DELAY_MS,
                    detail: format!("'{v}' is not a whole number of milliseconds"),
                })?),
            },
        };
        let mut l = l;
        l.worker = match env.var(rv::ENV_WORKER_ID) {
            Some(v) => v.trim().parse().map_err(|_| Error::Env {
                var: rv::ENV_WORKER_ID,
                detail: format!("'{v}' is not a non-negative integer"),
            })?,
            None => l.rank as u64,
        };
        let check = |ok: bool, var: &'static str, what: String| {
            if ok {
                Ok(())
            } else {
                Err(Error::Env { var, detail: what })
            }
        };
        check(l.size > 0, rv::ENV_SIZE, "must be at least 1".into())?;
        check(
            l.rank < l.size,
            rv::ENV_RANK,
            format!("{} is not below size {}", l.rank, l.size),
        )?;
        check(
            l.local_rank < l.local_size,
            rv::ENV_LOCAL_RANK,
            format!("{} is not below local size {}", l.local_rank, l.local_size),
        )?;
        check(
            l.cross_rank < l.cross_size,
            rv::ENV_CROSS_RANK,
            format!("{} is not below cross size {}", l.cross_rank, l.cross_size),
        )?;
        Ok(Some(l))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect()
    }

    fn full() -> HashMap<String, String> {
        env(&[
            (rv::ENV_RENDEZVOUS_ADDR, "127.0.0.1:9"),
            (rv::ENV_RANK, "1"),
            (rv::ENV_SIZE, "4"),
            (rv::ENV_LOCAL_RANK, "1"),
            (rv::ENV_LOCAL_SIZE, "2"),
            (rv::ENV_CROSS_RANK, "0"),
            (rv::ENV_CROSS_SIZE, "2"),
            (rv::ENV_HOSTNAME, "127.0.0.2"),
            (rv::ENV_SECRET, "s"),
            (rv::ENV_BIND_ADDR, "127.0.0.2"),
        ])
    }

    #[test]
    fn no_launcher_means_a_world_of_one() {
        assert_eq!(Launch::from_env(&env(&[])).unwrap(), None);
    }

    #[test]
    fn a_foreign_launcher_is_named() {
        let e = Launch::from_env(&env(&[(rv::ENV_RANK, "0")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("HVD_RENDEZVOUS_ADDR") && e.contains("launcher other than"),
            "{e}"
        );
    }

    #[test]
    fn reads_and_checks_every_variable() {
        let l = Launch::from_env(&full()).unwrap().unwrap();
        assert_eq!((l.rank, l.size, l.local_rank, l.cross_size), (1, 4, 1, 2));
        assert_eq!(l.progress_timeout, Duration::from_secs(5));
        assert_eq!(l.hierarchical, None);
        for (v, want) in [("1", Some(true)), ("0", Some(false))] {
            let mut e = full();
            e.insert(rv::ENV_HIERARCHICAL_ALLREDUCE.into(), v.into());
            assert_eq!(Launch::from_env(&e).unwrap().unwrap().hierarchical, want);
        }
        assert_eq!(l.streams, 1);
        assert_eq!(l.connect_delay, Duration::ZERO);
        let mut e = full();
        e.insert(ENV_TEST_CONNECT_DELAY_MS.into(), "250".into());
        let delayed = Launch::from_env(&e).unwrap().unwrap();
        assert_eq!(delayed.connect_delay, Duration::from_millis(250));
        e.insert(ENV_TEST_CONNECT_DELAY_MS.into(), "soon".into());
        let err = Launch::from_env(&e).unwrap_err().to_string();
        assert!(err.contains("HVD_TEST_CONNECT_DELAY_MS"), "{err}");
        assert_eq!(rv::MAX_TCP_STREAMS, hvd_collectives::MAX_STREAMS);
        let mut e = full();
        e.insert(rv::ENV_TCP_STREAMS.into(), "4".into());
        assert_eq!(Launch::from_env(&e).unwrap().unwrap().streams, 4);
        for v in ["0", "16", "two"] {
            let mut bad = full();
            bad.insert(rv::ENV_TCP_STREAMS.into(), v.into());
            let e = Launch::from_env(&bad).unwrap_err().to_string();
            assert!(e.contains("HVD_TCP_STREAMS") && e.contains(v), "{e}");
        }
        assert_eq!(l.hierarchical_allgather, None);
        let mut e = full();
        // Read as Horovod reads it: an integer above 0 is on.
        for on in ["1", "2"] {
            e.insert(rv::ENV_HIERARCHICAL_ALLGATHER.into(), on.into());
            assert_eq!(
                Launch::from_env(&e)
                    .unwrap()
                    .unwrap()
                    .hierarchical_allgather,
                Some(true),
                "{on}"
            );
        }
        e.insert(rv::ENV_HIERARCHICAL_ALLGATHER.into(), "on".into());
        let err = Launch::from_env(&e).unwrap_err().to_string();
        assert!(
            err.contains("HOROVOD_HIERARCHICAL_ALLGATHER") && err.contains("'on'"),
            "{err}"
        );
        // Horovod's Gloo timeout is the arrival timeout, unless hvd's own variable is set.
        assert_eq!(l.arrival_timeout, Duration::from_secs(300));
        let mut e = full();
        e.insert(rv::ENV_GLOO_TIMEOUT_SECONDS.into(), "45".into());
        let gloo = Launch::from_env(&e).unwrap().unwrap();
        assert_eq!(gloo.arrival_timeout, Duration::from_secs(45));
        e.insert(rv::ENV_ARRIVAL_TIMEOUT.into(), "9".into());
        assert_eq!(
            Launch::from_env(&e).unwrap().unwrap().arrival_timeout,
            Duration::from_secs(9)
        );
        let mut bad = full();
        bad.insert(rv::ENV_GLOO_TIMEOUT_SECONDS.into(), "0".into());
        let err = Launch::from_env(&bad).unwrap_err().to_string();
        assert!(
            err.contains("HOROVOD_GLOO_TIMEOUT_SECONDS") && err.contains("'0'"),
            "{err}"
        );
        let mut bad = full();
        bad.insert(rv::ENV_HIERARCHICAL_ALLREDUCE.into(), "yes".into());
        let e = Launch::from_env(&bad).unwrap_err().to_string();
        assert!(
            e.contains("HOROVOD_HIERARCHICAL_ALLREDUCE") && e.contains("'yes'"),
            "{e}"
        );
        let mut bad = full();
        bad.insert(rv::ENV_RANK.into(), "4".into());
        let e = Launch::from_env(&bad).unwrap_err().to_string();
        assert_eq!(
            e,
            "environment variable HOROVOD_RANK: 4 is not below size 4"
        );
        let mut bad = full();
        bad.insert(rv::ENV_COLLECTIVE_TIMEOUT.into(), "-1".into());
        assert!(
            Launch::from_env(&bad)
                .unwrap_err()
                .to_string()
                .contains("HVD_COLLECTIVE_TIMEOUT")
        );
        let mut bad = full();
        bad.remove(rv::ENV_SECRET);
        assert!(
            Launch::from_env(&bad)
                .unwrap_err()
                .to_string()
                .contains("HVD_SECRET: not set")
        );
    }
}
