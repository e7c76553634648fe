//! A small path-tracking reader over `serde_json::Value`.
//!
//! serde's derive gives errors such as `invalid type: string "x", expected u32 at line
//! 3 column 9`, which do not name the field. The what-if inputs are read through this
//! reader instead, so that every error has the `<path>: <allowed>, got <value>` shape
//! of [`ConfigError`], and unknown fields are refused rather than silently ignored
//! (a typo such as `cooldwn` must not fall back to a default without a word).

use std::time::Duration;

use serde_json::{Map, Value};

use crate::duration::{format_as_seconds, parse_duration};
use crate::error::{ConfigError, PathStep};

/// Renders a JSON value for the `got ...` part of a message.
pub(crate) fn show(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 60 {
        let cut: String = s.chars().take(57).collect();
        format!("{cut}...")
    } else {
        s
    }
}

/// An object being read, with its path from the document root.
pub(crate) struct Obj<'a> {
    pub map: &'a Map<String, Value>,
    pub path: Vec<PathStep>,
}

pub(crate) fn child(path: &[PathStep], step: impl Into<PathStep>) -> Vec<PathStep> {
    let mut p = path.to_vec();
    p.push(step.into());
    p
}

pub(crate) fn as_object<'a>(
    v: &'a Value,
    path: Vec<PathStep>,
    allowed: &[&str],
) -> Result<Obj<'a>, ConfigError> {
    let map = v
        .as_object()
        .ok_or_else(|| ConfigError::new(path.clone(), "must be an object", show(v)))?;
    for key in map.keys() {
        if !allowed.contains(&key.as_str()) {
            return Err(ConfigError::new(
                child(&path, key.as_str()),
                format!("must be one of the known fields ({})", allowed.join(", ")),
                "an unknown field",
            ));
        }
    }
    Ok(Obj { map, path })
}

pub(crate) fn as_array<'a>(v: &'a Value, path: &[PathStep]) -> Result<&'a [Value], ConfigError> {
    v.as_array()
        .map(|a| a.as_slice())
        .ok_or_else(|| ConfigError::new(path.to_vec(), "must be a list", show(v)))
}

impl<'a> Obj<'a> {
    pub fn path_of(&self, key: &str) -> Vec<PathStep> {
        child(&self.path, key)
    }

    /// The value of `key`, treating JSON `null` as absent.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    pub fn required(&self, key: &str) -> Result<&'a Value, ConfigError> {
        self.get(key)
            .ok_or_else(|| ConfigError::new(self.path_of(key), "must be set", "nothing"))
    }

    pub fn u32_opt(&self, key: &str) -> Result<Option<u32>, ConfigError> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| {
                        ConfigError::new(
                            self.path_of(key),
                            "must be a whole number from 0 to 4294967295",
                            show(v),
                        )
                    })
            })
            .transpose()
    }

    pub fn u32_req(&self, key: &str) -> Result<u32, ConfigError> {
        self.required(key)?;
        Ok(self.u32_opt(key)?.unwrap_or_default())
    }

    pub fn u64_req(&self, key: &str) -> Result<u64, ConfigError> {
        let v = self.required(key)?;
        v.as_u64().ok_or_else(|| {
            ConfigError::new(
                self.path_of(key),
                "must be a whole number of seconds, 0 or more",
                show(v),
            )
        })
    }

    pub fn f64_opt(&self, key: &str) -> Result<Option<f64>, ConfigError> {
        self.get(key)
            .map(|v| {
                v.as_f64()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| ConfigError::new(self.path_of(key), "must be a number", show(v)))
            })
            .transpose()
    }

    pub fn f64_req(&self, key: &str) -> Result<f64, ConfigError> {
        self.required(key)?;
        Ok(self.f64_opt(key)?.unwrap_or_default())
    }

    pub fn str_opt(&self, key: &str) -> Result<Option<&'a str>, ConfigError> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| ConfigError::new(self.path_of(key), "must be a string", show(v)))
            })
            .transpose()
    }

    pub fn str_req(&self, key: &str) -> Result<&'a str, ConfigError> {
        self.required(key)?;
        Ok(self.str_opt(key)?.unwrap_or_default())
    }

    /// A duration: a Terraform-style string (`"90s"`, `"1m30s"`) or a number of seconds.
    pub fn duration_opt(&self, key: &str) -> Result<Option<Duration>, ConfigError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let bad = || {
            ConfigError::new(
                self.path_of(key),
                "must be a duration such as \"30s\", \"2m\" or \"1h30m\", or a whole number of seconds",
                show(v),
            )
        };
        match v {
            Value::String(s) => parse_duration(s).map(Some).map_err(|_| bad()),
            Value::Number(n) => n
                .as_u64()
                .map(|s| Some(Duration::from_secs(s)))
                .ok_or_else(bad),
            _ => Err(bad()),
        }
    }

    pub fn duration_req(&self, key: &str) -> Result<Duration, ConfigError> {
        self.required(key)?;
        Ok(self.duration_opt(key)?.unwrap_or_default())
    }
}

/// `got` text for a duration, in the seconds form the messages use (`90s`).
pub(crate) fn show_duration(d: Duration) -> String {
    format_as_seconds(d)
}
