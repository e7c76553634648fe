//! Durations in Terraform's usual string form (`"30s"`, `"2m"`, `"1h30m"`, `"500ms"`).
//!
//! The grammar is the one Go's `time.ParseDuration` accepts for non-negative,
//! integer amounts: one or more `<digits><unit>` pairs, unit one of `h`, `m`, `s`,
//! `ms`. A bare `0` is accepted as zero. Everything lbscale schedules is counted in
//! whole milliseconds.

use std::fmt;
use std::time::Duration;

/// Why a duration string was refused; the message is meant to follow a field name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("must be a duration such as \"30s\", \"2m\" or \"1h30m\" (units h, m, s, ms), got {0:?}")]
pub struct DurationError(pub String);

/// Parses `"1h30m"`-style strings.
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let err = || DurationError(text.to_string());
    let s = text.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() {
        return Err(err());
    }
    let bytes = s.as_bytes();
    let mut i = 0;
    let mut total_ms: u64 = 0;
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        if start == i {
            return Err(err());
        }
        let amount: u64 = s[start..i].parse().map_err(|_| err())?;
        let unit_start = i;
        while i < bytes.len() && bytes[i].is_ascii_alphabetic() {
            i += 1;
        }
        let unit_ms: u64 = match &s[unit_start..i] {
            "h" => 3_600_000,
            "m" => 60_000,
            "s" => 1_000,
            "ms" => 1,
            _ => return Err(err()),
        };
        total_ms = amount
            .checked_mul(unit_ms)
            .and_then(|v| total_ms.checked_add(v))
            .ok_or_else(err)?;
    }
    Ok(Duration::from_millis(total_ms))
}

/// Formats a duration the way `parse_duration` reads it, shortest form first
/// (`90s` prints as `1m30s`).
pub fn format_duration(d: Duration) -> String {
    let mut ms = d.as_millis() as u64;
    if ms == 0 {
        return "0s".into();
    }
    let mut out = String::new();
    for (unit, size) in [("h", 3_600_000u64), ("m", 60_000), ("s", 1_000), ("ms", 1)] {
        if ms >= size {
            out.push_str(&format!("{}{}", ms / size, unit));
            ms %= size;
        }
    }
    out
}

/// Formats a duration in whole seconds (`60s`, `90s`), or milliseconds when it is not
/// a whole number of seconds (`1500ms`). Error messages use this form because it is
/// the one that makes multiples easy to see: "a multiple of 60s, got 90s".
pub fn format_as_seconds(d: Duration) -> String {
    let ms = d.as_millis();
    if ms % 1000 == 0 {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// A `Duration` that serialises as its string form, for JSON inputs and outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct TextDuration(pub Duration);

impl fmt::Display for TextDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_duration(self.0))
    }
}

impl serde::Serialize for TextDuration {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_duration(self.0))
    }
}

impl<'de> serde::Deserialize<'de> for TextDuration {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        parse_duration(&text)
            .map(TextDuration)
            .map_err(serde::de::Error::custom)
    }
}

/// A duration setting as the user declared it: parsed once, when it is read, and
/// kept with the text it was written as, so that what Terraform shows back is
/// what the configuration says (`"90s"` stays `"90s"`, not `"1m30s"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeclaredDuration {
    text: String,
    value: Duration,
}

impl DeclaredDuration {
    /// Reads `text`; the error is meant to follow the setting's name.
    pub fn parse(text: &str) -> Result<Self, DurationError> {
        Ok(Self {
            value: parse_duration(text)?,
            text: text.to_string(),
        })
    }

    /// The setting in its shortest text form (for settings made in code).
    pub fn of(value: Duration) -> Self {
        Self {
            text: format_duration(value),
            value,
        }
    }

    pub fn get(&self) -> Duration {
        self.value
    }

    /// The text as declared.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for DeclaredDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl serde::Serialize for DeclaredDuration {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de> serde::Deserialize<'de> for DeclaredDuration {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        DeclaredDuration::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_terraform_forms() {
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
    }

    #[test]
    fn refuses_garbage_and_names_the_value() {
        for bad in ["", "10", "1.5m", "-1s", "5 minutes", "3d", "m"] {
            let e = parse_duration(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn seconds_form_for_messages() {
        assert_eq!(format_as_seconds(Duration::from_secs(90)), "90s");
        assert_eq!(format_as_seconds(Duration::from_millis(1500)), "1500ms");
        assert_eq!(format_as_seconds(Duration::ZERO), "0s");
    }

    #[test]
    fn a_declared_duration_keeps_its_text_and_reads_once() {
        let d: DeclaredDuration = serde_json::from_str("\"90s\"").unwrap();
        assert_eq!(d.get(), Duration::from_secs(90));
        assert_eq!(serde_json::to_string(&d).unwrap(), "\"90s\"");
        let e = serde_json::from_str::<DeclaredDuration>("\"90\"").unwrap_err();
        assert!(e.to_string().contains("\"90\""), "{e}");
    }

    #[test]
    fn format_round_trips() {
        for s in ["1m30s", "1h", "45s", "250ms", "0s"] {
            assert_eq!(format_duration(parse_duration(s).unwrap()), s);
        }
    }
}
