//! Configuration errors that name the field they are about.
//!
//! Every invalid input, whether it arrives as Terraform attributes, as a JSON file for
//! `lbscale simulate` or from the daemon's store, is reported the same way:
//! `<field path>: <what is allowed>, got <value>`. The path is kept structured
//! ([`PathStep`]s) rather than as a pre-rendered string, so that the Terraform
//! provider can map it onto an attribute path for its diagnostics while the CLI
//! renders it as `group.thresholds[0].min`.

use std::fmt;

/// One step of a path into a configuration document.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PathStep {
    /// A named field (object key, Terraform attribute or block name).
    Field(String),
    /// A position in a list (JSON array, Terraform list or block list).
    Index(usize),
}

impl From<&str> for PathStep {
    fn from(name: &str) -> Self {
        PathStep::Field(name.to_string())
    }
}

impl From<usize> for PathStep {
    fn from(i: usize) -> Self {
        PathStep::Index(i)
    }
}

/// The name an error about the whole document (the empty path) goes by, so that the
/// one-line form always names a field: `input: must be an object, got [1,2]`.
pub const ROOT_NAME: &str = "input";

/// Renders a path the way operators write it: `group.thresholds[0].min`; the empty
/// path (the document itself) renders as [`ROOT_NAME`].
pub fn render_path(path: &[PathStep]) -> String {
    if path.is_empty() {
        return ROOT_NAME.to_string();
    }
    let mut out = String::new();
    for step in path {
        match step {
            PathStep::Field(name) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(name);
            }
            PathStep::Index(i) => {
                out.push_str(&format!("[{i}]"));
            }
        }
    }
    out
}

/// An invalid value: where it is, what would have been allowed, and what was given.
///
/// `Display` gives the one-line form `group.watch_time: must be a positive multiple of
/// stats_interval (60s), got 90s`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Where the value is, from the root of the document the caller validated.
    pub path: Vec<PathStep>,
    /// What is allowed, phrased to follow the path: `must be at least 1`.
    pub allowed: String,
    /// The offending value as the operator wrote it (strings quoted).
    pub got: String,
}

impl ConfigError {
    /// An error about the field at `path`.
    pub fn new<P, I>(path: P, allowed: impl Into<String>, got: impl Into<String>) -> Self
    where
        P: IntoIterator<Item = I>,
        I: Into<PathStep>,
    {
        ConfigError {
            path: path.into_iter().map(Into::into).collect(),
            allowed: allowed.into(),
            got: got.into(),
        }
    }

    /// The same error seen from one level up: validators report paths relative to
    /// the block they were given, and callers prefix the block's own position.
    pub fn under(mut self, prefix: impl Into<PathStep>) -> Self {
        self.path.insert(0, prefix.into());
        self
    }

    /// Like [`ConfigError::under`] with several steps, outermost first.
    pub fn under_path(mut self, prefix: &[PathStep]) -> Self {
        let mut path = prefix.to_vec();
        path.append(&mut self.path);
        self.path = path;
        self
    }

    /// The rendered path, `group.thresholds[0].min`.
    pub fn path_string(&self) -> String {
        render_path(&self.path)
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {}, got {}",
            self.path_string(),
            self.allowed,
            self.got
        )
    }
}

impl std::error::Error for ConfigError {}

/// Renders a number the way an operator typed it: `90`, not `90.0`.
pub(crate) fn num(v: f64) -> String {
    format!("{v}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_fields_and_indexes() {
        let e = ConfigError::new(["min"], "must be below max (85)", "90")
            .under(0usize)
            .under("thresholds")
            .under("group");
        assert_eq!(e.path_string(), "group.thresholds[0].min");
        assert_eq!(
            e.to_string(),
            "group.thresholds[0].min: must be below max (85), got 90"
        );
    }

    #[test]
    fn root_path_is_named() {
        let e = ConfigError::new(Vec::<PathStep>::new(), "must be an object", "[1,2]");
        assert!(e.path.is_empty(), "the structured path stays the root");
        assert_eq!(e.path_string(), "input");
        assert_eq!(e.to_string(), "input: must be an object, got [1,2]");
    }

    #[test]
    fn prefix_path_keeps_order() {
        let e = ConfigError::new(["watch_time"], "x", "y")
            .under_path(&[PathStep::Field("resource".into()), PathStep::Index(2)]);
        assert_eq!(e.path_string(), "resource[2].watch_time");
    }
}
