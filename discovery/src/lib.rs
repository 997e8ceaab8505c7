//! Where hosts come from, and which of them to keep out.
//!
//! - [`parse_host_list`] and [`parse_hostfile`]: the static sources, `-H host1:2,host2:4` and
//!   hostfiles (`host slots=N` a line, `#` comments).
//! - [`ScriptDiscovery`]: runs a `--host-discovery-script` under a timeout and parses its
//!   `host[:slots]` lines with [`parse_discovery_output`].
//! - [`Blacklist`]: hosts whose workers failed, kept out for a cooldown that doubles with each
//!   failure (`--blacklist-cooldown-range`), driven by the caller's clock.
//! - `kubernetes` (feature `kubernetes`): the Ready worker pods matching a label selector, kept
//!   current by a watch on the API server.
//!
//! Every parser error names the bad entry or line.
//!
//! ```
//! use hvd_discovery::{HostSpec, parse_discovery_output};
//!
//! let hosts = parse_discovery_output("# pool\nnode1:4\nnode2\n", Some(2)).unwrap();
//! assert_eq!(hosts[1], HostSpec { host: "node2".into(), slots: 2 });
//! ```

mod blacklist;
mod hosts;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;
mod script;

pub use blacklist::{Blacklist, Blacklisting, CooldownRange, CooldownRangeError, Released};
pub use hosts::{HostParseError, HostSpec, parse_host_list, parse_hostfile};
pub use script::{DiscoveryError, MAX_OUTPUT_BYTES, ScriptDiscovery, parse_discovery_output};
