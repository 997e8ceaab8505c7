//! Elastic mode: the deterministic core and the I/O that drives it.

pub mod control;
pub mod core;
pub mod run;
#[cfg(test)]
mod sim;
