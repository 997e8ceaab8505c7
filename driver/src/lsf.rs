//! The hosts of the LSF job `horovodrun` runs in, for `horovodrun python train.py` with no
//! `-H`, `--hostfile` or discovery.
//!
//! Horovod (`_run` in `horovod/runner/launch.py`, `LSFUtils` in `horovod/runner/util/lsf.py`)
//! takes a job with `LSB_JOBID` set for an LSF job. There `-np` defaults to every slot of the
//! job, and with no `-H`, `--hostfile` or discovery script the hosts are the job's. Horovod
//! asks IBM CSM for them (`csm_allocation_query -a $CSM_ALLOCATION_ID`): its compute nodes,
//! sorted by name, each with as many slots as it has GPUs. CSM lists compute nodes only, so
//! the launch node the job script runs on is not among them.
//!
//! hvd reads the same allocation from LSF's own variables, which every LSF job has (CSM exists
//! only on IBM's CORAL machines): `LSB_MCPU_HOSTS` (`host1 4 host2 4`, a host and its slots in
//! pairs), else `LSB_HOSTS` (each host once per slot). A host gets a worker per LSF slot, not
//! per GPU. Where `CSM_ALLOCATION_ID` is set, LSF lists the launch node first, holding the job
//! script's one slot (`batch1 1 a01n01 42 a01n02 42`): it is left out, so that the hosts are
//! the compute nodes Horovod would get from CSM. The hosts are sorted by name, as Horovod's.

use std::collections::BTreeMap;

use hvd_discovery::HostSpec;

/// Set in every LSF job: Horovod's test for running in one.
pub const ENV_JOB_ID: &str = "LSB_JOBID";
/// The job's hosts and their slots, in pairs: `host1 4 host2 4`.
pub const ENV_MCPU_HOSTS: &str = "LSB_MCPU_HOSTS";
/// The job's hosts, each repeated once per slot: `host1 host1 host2`.
pub const ENV_HOSTS: &str = "LSB_HOSTS";
/// Set where IBM CSM manages the allocation (where Horovod asks CSM for the hosts); LSF then
/// lists the launch node first.
pub const ENV_CSM_ALLOCATION: &str = "CSM_ALLOCATION_ID";

/// An LSF job whose variables don't say which hosts it has.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LsfError {
    /// An LSF job without a host list.
    #[error(
        "{ENV_JOB_ID} is set (an LSF job), but neither {ENV_MCPU_HOSTS} nor {ENV_HOSTS} lists \
         the job's hosts; name them with -H or --hostfile"
    )]
    NoHosts,
    /// A host of `LSB_MCPU_HOSTS` without a slot count after it.
    #[error(
        "{ENV_MCPU_HOSTS}='{text}': host '{host}' has no slot count after it (the variable holds `host slots` pairs)"
    )]
    Unpaired {
        /// The variable's value.
        text: String,
        /// The host without a count.
        host: String,
    },
    /// A slot count of `LSB_MCPU_HOSTS` that is not a positive number.
    #[error(
        "{ENV_MCPU_HOSTS}='{text}': the slot count '{slots}' of host '{host}' is not a positive number"
    )]
    BadSlots {
        /// The variable's value.
        text: String,
        /// The host.
        host: String,
        /// The count as written.
        slots: String,
    },
    /// Only the launch node of a CSM allocation: no host to run a worker on.
    #[error(
        "{var}='{text}' lists only the launch node of this CSM allocation ({ENV_CSM_ALLOCATION} \
         is set), no compute host; name the hosts with -H or --hostfile"
    )]
    OnlyLaunchNode {
        /// The variable read.
        var: &'static str,
        /// Its value.
        text: String,
    },
}

/// The hosts of the LSF job described by `env` (a lookup of environment variables), sorted by
/// name; `None` outside an LSF job (no `LSB_JOBID`). A blank variable counts as unset.
///
/// # Errors
/// An LSF job without a usable host list: each error names the variable and its text.
pub fn hosts(env: impl Fn(&str) -> Option<String>) -> Result<Option<Vec<HostSpec>>, LsfError> {
    if env(ENV_JOB_ID).is_none() {
        return Ok(None);
    }
    let set = |name: &str| env(name).filter(|v| !v.trim().is_empty());
    let (var, text, mut list) = if let Some(text) = set(ENV_MCPU_HOSTS) {
        let list = pairs(&text)?;
        (ENV_MCPU_HOSTS, text, list)
    } else if let Some(text) = set(ENV_HOSTS) {
        let list = text
            .split_whitespace()
            .map(|h| (h.to_string(), 1))
            .collect();
        (ENV_HOSTS, text, list)
    } else {
        return Err(LsfError::NoHosts);
    };
    if env(ENV_CSM_ALLOCATION).is_some() && !list.is_empty() {
        let launch = list.remove(0);
        tracing::debug!(host = %launch.0, "LSF's first host is the CSM allocation's launch node; left out");
        if list.is_empty() {
            return Err(LsfError::OnlyLaunchNode { var, text });
        }
    }
    let mut slots: BTreeMap<String, usize> = BTreeMap::new();
    for (host, n) in list {
        *slots.entry(host).or_default() += n;
    }
    Ok(Some(
        slots
            .into_iter()
            .map(|(host, slots)| HostSpec { host, slots })
            .collect(),
    ))
}

/// `LSB_MCPU_HOSTS`'s `host slots` pairs, in order (never empty: `text` is not blank).
fn pairs(text: &str) -> Result<Vec<(String, usize)>, LsfError> {
    let words: Vec<&str> = text.split_whitespace().collect();
    words
        .chunks(2)
        .map(|pair| match *pair {
            [host, slots] => match slots.parse::<usize>() {
                Ok(n) if n > 0 => Ok((host.to_string(), n)),
                _ => Err(LsfError::BadSlots {
                    text: text.to_string(),
                    host: host.to_string(),
                    slots: slots.to_string(),
                }),
            },
            _ => Err(LsfError::Unpaired {
                text: text.to_string(),
                host: pair.first().map_or_else(String::new, |h| h.to_string()),
            }),
        })
        .collect()
}

/// Every slot of `hosts`: the `-np` of a job that gives none.
pub fn total_slots(hosts: &[HostSpec]) -> usize {
    hosts.iter().map(|h| h.slots).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lsf(vars: &[(&str, &str)]) -> Result<Option<Vec<HostSpec>>, LsfError> {
        hosts(|k| {
            vars.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.to_string())
        })
    }

    fn specs(list: &[(&str, usize)]) -> Option<Vec<HostSpec>> {
        Some(
            list.iter()
                .map(|&(host, slots)| HostSpec {
                    host: host.into(),
                    slots,
                })
                .collect(),
        )
    }

    #[test]
    fn outside_an_lsf_job_there_are_no_lsf_hosts() {
        assert_eq!(lsf(&[]), Ok(None));
        // Horovod's test is LSB_JOBID alone: a stray host list is no LSF job.
        assert_eq!(lsf(&[("LSB_MCPU_HOSTS", "a 2")]), Ok(None));
    }

    #[test]
    fn mcpu_hosts_pairs_give_hosts_and_slots_sorted_by_name() {
        let got = lsf(&[
            ("LSB_JOBID", "7"),
            ("LSB_MCPU_HOSTS", " nodeB 4  nodeA 2 \n"),
        ]);
        assert_eq!(got, Ok(specs(&[("nodeA", 2), ("nodeB", 4)])));
        let single = lsf(&[("LSB_JOBID", "7"), ("LSB_MCPU_HOSTS", "127.0.0.1 2")]);
        assert_eq!(single, Ok(specs(&[("127.0.0.1", 2)])));
        // LSB_MCPU_HOSTS wins over LSB_HOSTS; a host named twice has both counts.
        let both = lsf(&[
            ("LSB_JOBID", "7"),
            ("LSB_MCPU_HOSTS", "a 1 b 2 a 3"),
            ("LSB_HOSTS", "z z"),
        ]);
        assert_eq!(both, Ok(specs(&[("a", 4), ("b", 2)])));
    }

    #[test]
    fn lsb_hosts_repeats_a_host_once_per_slot() {
        let got = lsf(&[("LSB_JOBID", "7"), ("LSB_HOSTS", "h2 h1 h1 h1 h2")]);
        assert_eq!(got, Ok(specs(&[("h1", 3), ("h2", 2)])));
        // A blank LSB_MCPU_HOSTS counts as unset.
        let blank = lsf(&[
            ("LSB_JOBID", "7"),
            ("LSB_MCPU_HOSTS", " "),
            ("LSB_HOSTS", "h1"),
        ]);
        assert_eq!(blank, Ok(specs(&[("h1", 1)])));
    }

    #[test]
    fn a_csm_allocation_leaves_out_the_launch_node_listed_first() {
        let csm = ("CSM_ALLOCATION_ID", "1234");
        let got = lsf(&[
            ("LSB_JOBID", "7"),
            csm,
            ("LSB_MCPU_HOSTS", "batch1 1 a01n02 42 a01n01 42"),
        ]);
        assert_eq!(got, Ok(specs(&[("a01n01", 42), ("a01n02", 42)])));
        let got = lsf(&[("LSB_JOBID", "7"), csm, ("LSB_HOSTS", "batch1 c1 c1")]);
        assert_eq!(got, Ok(specs(&[("c1", 2)])));
        let only = lsf(&[("LSB_JOBID", "7"), csm, ("LSB_MCPU_HOSTS", "batch1 1")]);
        assert_eq!(
            only.unwrap_err().to_string(),
            "LSB_MCPU_HOSTS='batch1 1' lists only the launch node of this CSM allocation \
             (CSM_ALLOCATION_ID is set), no compute host; name the hosts with -H or --hostfile"
        );
        // Without CSM the first host is a compute host like the others.
        let got = lsf(&[("LSB_JOBID", "7"), ("LSB_MCPU_HOSTS", "batch1 1 c1 2")]);
        assert_eq!(got, Ok(specs(&[("batch1", 1), ("c1", 2)])));
    }

    #[test]
    fn malformed_values_are_named_with_their_text() {
        let err = |v: &str| {
            lsf(&[("LSB_JOBID", "7"), ("LSB_MCPU_HOSTS", v)])
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            err("host1 4 host2"),
            "LSB_MCPU_HOSTS='host1 4 host2': host 'host2' has no slot count after it (the \
             variable holds `host slots` pairs)"
        );
        assert_eq!(
            err("host1 four"),
            "LSB_MCPU_HOSTS='host1 four': the slot count 'four' of host 'host1' is not a \
             positive number"
        );
        assert!(err("host1 0").contains("the slot count '0' of host 'host1'"));
        assert!(err("host1 -2").contains("'-2'"));
        // Host names where counts belong: the first count is the second host's name.
        assert!(err("host1 host2 3 4").contains("the slot count 'host2' of host 'host1'"));
        assert_eq!(
            lsf(&[("LSB_JOBID", "7")]).unwrap_err().to_string(),
            "LSB_JOBID is set (an LSF job), but neither LSB_MCPU_HOSTS nor LSB_HOSTS lists the \
             job's hosts; name them with -H or --hostfile"
        );
        assert_eq!(
            lsf(&[("LSB_JOBID", "7"), ("LSB_HOSTS", "\t")]),
            Err(LsfError::NoHosts)
        );
    }

    #[test]
    fn total_slots_adds_every_host() {
        assert_eq!(total_slots(&specs(&[("a", 2), ("b", 3)]).unwrap()), 5);
    }
}
