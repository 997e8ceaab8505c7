//! Where hosts come from. This crate parses the static sources: `-H host1:2,host2:4` and
//! hostfiles (`host slots=N` a line, `#` comments), with errors that name the bad entry.

mod hosts;

pub use hosts::{HostParseError, HostSpec, parse_host_list, parse_hostfile};
