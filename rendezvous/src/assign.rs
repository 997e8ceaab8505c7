//! Static rank assignment: slots filled host by host, in the order the hosts were given.

use crate::Placement;

/// A host and how many worker slots it offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSlots {
    /// Host name or address.
    pub host: String,
    /// Worker slots on it.
    pub slots: usize,
}

/// Where one worker runs and the ranks Horovod gives it (through `Deref`, `slot.rank`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotInfo {
    /// The host.
    pub host: String,
    /// Its six Horovod numbers.
    pub placement: Placement,
}

impl std::ops::Deref for SlotInfo {
    type Target = Placement;
    fn deref(&self) -> &Placement {
        &self.placement
    }
}

impl SlotInfo {
    /// The six Horovod numbers of this slot.
    pub fn placement(&self) -> Placement {
        self.placement
    }
}

/// Why workers can't be placed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssignError {
    /// More processes were asked for than the hosts have slots.
    #[error("-np {np} is larger than the {available} slots available on {hosts}")]
    NotEnoughSlots {
        /// Processes asked for.
        np: usize,
        /// Slots the hosts offer.
        available: usize,
        /// The hosts, as `host:slots` joined with commas.
        hosts: String,
    },
    /// `-np 0`.
    #[error("-np must be at least 1")]
    Empty,
}

/// Places `np` workers on `hosts`, filling each host's slots before moving to the next, as
/// `horovodrun` does.
///
/// # Errors
/// [`AssignError::NotEnoughSlots`] when the hosts offer fewer than `np` slots.
pub fn assign_static(hosts: &[HostSlots], np: usize) -> Result<Vec<SlotInfo>, AssignError> {
    if np == 0 {
        return Err(AssignError::Empty);
    }
    let available: usize = hosts.iter().map(|h| h.slots).sum();
    if np > available {
        let hosts = hosts
            .iter()
            .map(|h| format!("{}:{}", h.host, h.slots))
            .collect::<Vec<_>>();
        return Err(AssignError::NotEnoughSlots {
            np,
            available,
            hosts: hosts.join(","),
        });
    }
    let mut used = Vec::new(); // (host, workers placed there)
    let mut left = np;
    for h in hosts {
        let k = h.slots.min(left);
        if k > 0 {
            used.push((h.host.clone(), k));
        }
        left -= k;
    }
    let mut out = Vec::with_capacity(np);
    for (host_index, (host, local_size)) in used.iter().enumerate() {
        for local_rank in 0..*local_size {
            let cross_rank = used[..host_index]
                .iter()
                .filter(|(_, k)| *k > local_rank)
                .count();
            let cross_size = used.iter().filter(|(_, k)| *k > local_rank).count();
            out.push(SlotInfo {
                host: host.clone(),
                placement: Placement {
                    rank: out.len(),
                    size: np,
                    local_rank,
                    local_size: *local_size,
                    cross_rank,
                    cross_size,
                },
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(spec: &[(&str, usize)]) -> Vec<HostSlots> {
        spec.iter()
            .map(|(h, s)| HostSlots {
                host: (*h).into(),
                slots: *s,
            })
            .collect()
    }

    #[test]
    fn fills_hosts_in_order_with_horovod_cross_ranks() {
        let a = assign_static(&hosts(&[("a", 2), ("b", 3), ("c", 4)]), 6).unwrap();
        let summary: Vec<_> = a
            .iter()
            .map(|s| {
                (
                    s.host.as_str(),
                    s.rank,
                    s.local_rank,
                    s.local_size,
                    s.cross_rank,
                    s.cross_size,
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                ("a", 0, 0, 2, 0, 3),
                ("a", 1, 1, 2, 0, 2),
                ("b", 2, 0, 3, 1, 3),
                ("b", 3, 1, 3, 1, 2),
                ("b", 4, 2, 3, 0, 1),
                ("c", 5, 0, 1, 2, 3),
            ]
        );
    }

    #[test]
    fn too_many_processes_is_a_clear_error() {
        let e = assign_static(&hosts(&[("a", 2), ("b", 1)]), 4).unwrap_err();
        assert_eq!(
            e.to_string(),
            "-np 4 is larger than the 3 slots available on a:2,b:1"
        );
        assert_eq!(
            assign_static(&hosts(&[("a", 1)]), 0).unwrap_err(),
            AssignError::Empty
        );
    }
}
