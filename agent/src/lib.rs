//! The hvd agent: starts, watches and stops training processes on behalf of the driver.
