//! The decision core of lbscale.
//!
//! Everything in this crate is a pure function of configuration, observed state and
//! a clock that the caller passes in: no I/O, no wall clock, no randomness. The same
//! code decides under `terraform apply`, in the daemon, in `lbscale simulate` and in
//! the `lbscale_scaling_simulation` data source.

pub mod duration;
