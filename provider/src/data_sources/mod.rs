//! Data sources.

pub mod distributor;
pub mod group;
pub mod simulation;
