//! The decision core of lbscale.
//!
//! Everything in this crate is a pure function of configuration, observed state and
//! a clock that the caller passes in: no I/O, no wall clock, no randomness. The same
//! code decides under `terraform apply`, in the daemon, in `lbscale simulate` and in
//! the `lbscale_scaling_simulation` data source.
//!
//! - [`policy`]: threshold autoscaling of one AZ cluster, as a level-triggered state
//!   machine, and the validation of scaling policies;
//! - [`apply`]: what an apply starts and removes, from the declared shape and the
//!   nodes observed;
//! - [`simulate`]: the what-if driver (metric trace in, timeline out);
//! - [`slowstart`]: caps and request shares of new services under slow start;
//! - [`seplan`]: how many nodes a vserver spans and which share each serves;
//! - [`error`]: configuration errors that name their field;
//! - [`utc`]: calendar dates from Unix time.

pub mod apply;
pub mod duration;
pub mod error;
mod jsonin;
pub mod policy;
pub mod seplan;
pub mod simulate;
pub mod slowstart;
pub mod utc;
