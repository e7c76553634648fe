//! Data sources.

pub mod group;
