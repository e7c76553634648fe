//! Data sources.

pub mod group;
pub mod simulation;
