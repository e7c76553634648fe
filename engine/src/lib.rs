//! lbscale's reconciliation engine.
//!
//! - [`model`]: the declared objects and their validation;
//! - [`store`]: the store shared by the provider and the daemon;
//! - [`cloud`]: the driver traits (where nodes come from, how clients reach them)
//!   and the registry of clouds by name that the embedding program fills (the
//!   drivers are crates of their own: `lbscale-cloud-local`, `lbscale-cloud-aws`);
//! - [`nodeapi`]: the client of a node's management API;
//! - [`placement`]: which nodes hold a vserver, and who forwards to whom;
//! - [`fault`]: a test hook that aborts the process at a named workflow step;
//! - [`reconcile`]: the [`Engine`], one module per job (groups, scale-out,
//!   scale-in and drain, join and configuration push, spans, distributors, SE
//!   groups, vservers, leases): level-triggered, it reads what is declared and
//!   what is observed and closes the gap;
//! - [`daemon_api`]: what the daemon asks of the engine.
//!
//! The decisions themselves (threshold policy, slow start, SE plan) live in
//! `lbscale-core`, which has no I/O.

pub mod cloud;
pub mod daemon_api;
pub mod fault;
pub mod model;
pub mod nodeapi;
mod pgtls;
pub mod placement;
pub mod reconcile;
mod sqldb;
pub mod store;
#[cfg(any(test, feature = "testing"))]
pub mod store_testing;
pub mod tlsroots;

pub use reconcile::{Engine, EngineError};
