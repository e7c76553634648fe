//! What every resource shares: the configured engine, schema builders, value
//! helpers, and diagnostics that name the attribute they are about.

use lbscale_engine::model::{Finding, Findings, PathStep, Severity};
use lbscale_engine::{Engine, EngineError};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use tf_provider::schema::{
    Attribute, AttributeConstraint, AttributeType, Block, Description, NestedBlock,
};
use tf_provider::value::Value;
use tf_provider::{AttributePath, Diagnostic, Diagnostics};

/// The engine, opened when Terraform configures the provider. Resources are built
/// before that, so they hold this handle.
pub type EngineHandle = Arc<OnceLock<Arc<Engine>>>;

pub fn engine(handle: &EngineHandle, diags: &mut Diagnostics) -> Option<Arc<Engine>> {
    match handle.get() {
        Some(e) => Some(e.clone()),
        None => {
            root_error(
                diags,
                "Provider not configured",
                "the lbscale provider was used before it was configured",
            );
            None
        }
    }
}

// --- diagnostics -------------------------------------------------------------------
// Built field by field: `Diagnostic::new` would append a backtrace.

pub fn error(
    diags: &mut Diagnostics,
    path: AttributePath,
    summary: impl Into<String>,
    detail: impl Into<String>,
) {
    diags.add_error(Diagnostic {
        summary: summary.into().into(),
        detail: detail.into().into(),
        attribute: path,
    });
}

pub fn warning(
    diags: &mut Diagnostics,
    path: AttributePath,
    summary: impl Into<String>,
    detail: impl Into<String>,
) {
    diags.add_warning(Diagnostic {
        summary: summary.into().into(),
        detail: detail.into().into(),
        attribute: path,
    });
}

pub fn root_error(diags: &mut Diagnostics, summary: impl Into<String>, detail: impl Into<String>) {
    error(diags, AttributePath::default(), summary, detail)
}

pub fn to_path(prefix: &AttributePath, steps: &[PathStep]) -> AttributePath {
    let mut p = prefix.clone();
    for s in steps {
        match s {
            PathStep::Attr(a) => {
                p.add_attribute(*a);
            }
            PathStep::Index(i) => {
                p.add_index(*i as i64);
            }
        }
    }
    p
}

pub fn add_finding(diags: &mut Diagnostics, f: Finding) {
    let d = Diagnostic {
        summary: f.summary.into(),
        detail: f.detail.into(),
        attribute: to_path(&AttributePath::default(), &f.path),
    };
    match f.severity {
        Severity::Error => diags.add_error(d),
        Severity::Warning => diags.add_warning(d),
    }
}

/// Adds the findings; `None` when one of them is an error.
pub fn report(diags: &mut Diagnostics, findings: Findings) -> Option<()> {
    let failed = findings.has_errors();
    for f in findings.0 {
        add_finding(diags, f);
    }
    (!failed).then_some(())
}

/// The value, or the engine's error added as a diagnostic (`None`).
pub fn done<T>(diags: &mut Diagnostics, what: &str, result: Result<T, EngineError>) -> Option<T> {
    result.map_err(|e| engine_error(diags, what, e)).ok()
}

/// Runs one of the engine's plan-time checks against the store and reports its
/// findings; `None` when one of them is an error.
pub fn plan_check(
    handle: &EngineHandle,
    diags: &mut Diagnostics,
    what: &str,
    check: impl FnOnce(&Engine) -> Result<Findings, EngineError>,
) -> Option<()> {
    let engine = engine(handle, diags)?;
    let findings = done(diags, what, check(&engine))?;
    report(diags, findings)
}

/// The id of the object that `terraform import` names; the import id is the name.
pub fn import_id(
    diags: &mut Diagnostics,
    kind: &str,
    name: &str,
    found: Result<Option<String>, EngineError>,
) -> Option<String> {
    match done(diags, &format!("import {kind}"), found)? {
        Some(id) => Some(id),
        None => {
            import_not_found(diags, kind, name);
            None
        }
    }
}

pub fn engine_error(diags: &mut Diagnostics, what: &str, e: EngineError) {
    match e {
        EngineError::Invalid(f) => add_finding(diags, f),
        other => root_error(diags, format!("lbscale: {what} failed"), other.to_string()),
    }
}

// --- values ------------------------------------------------------------------------

/// The value when it is known and set.
pub fn known<T>(v: &Value<T>) -> Option<&T> {
    v.as_ref_option()
}

/// Sets a null value to its default (Optional+Computed attributes with a default).
pub fn default_to<T>(v: &mut Value<T>, default: T) {
    if v.is_null() {
        *v = Value::Value(default);
    }
}

pub fn string(v: &Value<String>) -> String {
    known(v).cloned().unwrap_or_default()
}

// --- schema ------------------------------------------------------------------------

pub fn attr(t: AttributeType, c: AttributeConstraint, description: &str) -> Attribute {
    Attribute {
        attr_type: t,
        description: Description::markdown(description),
        constraint: c,
        sensitive: false,
        deprecated: false,
    }
}

pub fn required(t: AttributeType, d: &str) -> Attribute {
    attr(t, AttributeConstraint::Required, d)
}
pub fn optional(t: AttributeType, d: &str) -> Attribute {
    attr(t, AttributeConstraint::Optional, d)
}
/// Optional with a default that the plan fills in.
pub fn defaulted(t: AttributeType, d: &str) -> Attribute {
    attr(t, AttributeConstraint::OptionalComputed, d)
}
pub fn computed(t: AttributeType, d: &str) -> Attribute {
    attr(t, AttributeConstraint::Computed, d)
}
pub fn sensitive(mut a: Attribute) -> Attribute {
    a.sensitive = true;
    a
}

pub fn block(
    description: &str,
    attributes: Vec<(&str, Attribute)>,
    blocks: Vec<(&str, NestedBlock)>,
) -> Block {
    Block {
        version: 1,
        attributes: attributes
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect::<HashMap<_, _>>(),
        blocks: blocks
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        description: Description::markdown(description),
        deprecated: false,
    }
}

pub fn id_attr() -> Attribute {
    computed(
        AttributeType::String,
        "The object's id in the lbscale store.",
    )
}

/// The `terraform import` id is the object's name.
pub fn import_not_found(diags: &mut Diagnostics, kind: &str, name: &str) {
    root_error(
        diags,
        format!("Cannot import {kind}"),
        format!("no {kind} named {name:?} exists in the lbscale store (the import id is the name)"),
    )
}

pub fn changed<T: PartialEq>(a: &Value<T>, b: &Value<T>) -> bool {
    a != b
}

pub fn attr_path(name: &'static str) -> AttributePath {
    AttributePath::new(name)
}

/// The attributes that force a replacement, from `(attribute, changed)` pairs.
pub fn requires_replace(changes: &[(&'static str, bool)]) -> Vec<AttributePath> {
    changes
        .iter()
        .filter(|(_, changed)| *changed)
        .map(|(name, _)| attr_path(name))
        .collect()
}

/// A Terraform number that may have a fraction.
///
/// Terraform numbers are exact decimals: `10.3` in a configuration is not the
/// float64 nearest to it, and msgpack carries such a number as a decimal string.
/// A value planned or read back as a float would differ from the configuration
/// ("planned value does not match config value"). So a `Number` is written back as
/// the shortest decimal that reads as the same f64 (`10.3`), which is what the
/// operator wrote.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Default)]
pub struct Number(pub f64);

impl Number {
    /// The whole number this is, if it is one.
    pub fn whole(self) -> Option<i64> {
        (self.0.fract() == 0.0 && self.0.abs() < 9.0e15).then_some(self.0 as i64)
    }
}

impl From<i64> for Number {
    fn from(v: i64) -> Number {
        Number(v as f64)
    }
}

impl std::fmt::Display for Number {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// A number attribute that must be whole. It is read as any number, so that
/// `port = 80.5` reaches validation (which names the attribute and shows the
/// value) instead of failing to decode; a fraction is a finding here.
pub fn whole_number(
    findings: &mut Findings,
    path: Vec<PathStep>,
    field: &str,
    v: &Value<Number>,
) -> Option<i64> {
    let n = known(v)?;
    let whole = n.whole();
    if whole.is_none() {
        findings.0.push(Finding::error(
            path,
            format!("Invalid {field}"),
            format!("{field} must be a whole number, got {n}."),
        ));
    }
    whole
}

/// The value of a whole-number attribute that validation accepted.
pub fn int(v: &Value<Number>) -> Option<i64> {
    known(v).and_then(|n| n.whole())
}

impl serde::Serialize for Number {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0.is_finite() && self.0.fract() == 0.0 && self.0.abs() < 9.0e15 {
            s.serialize_i64(self.0 as i64)
        } else {
            s.serialize_str(&self.0.to_string())
        }
    }
}

impl<'de> serde::Deserialize<'de> for Number {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Number;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number")
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Number, E> {
                Ok(Number(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Number, E> {
                Ok(Number(v as f64))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Number, E> {
                Ok(Number(v as f64))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Number, E> {
                v.parse()
                    .map(Number)
                    .map_err(|_| E::custom(format!("{v:?} is not a number")))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_from_msgpack_ints_floats_and_decimal_strings() {
        for (bytes, want) in [
            (rmp_serde::to_vec(&7i64).unwrap(), 7.0),
            (rmp_serde::to_vec(&20.5f64).unwrap(), 20.5),
            (rmp_serde::to_vec("0.3").unwrap(), 0.3),
        ] {
            let v: Value<Number> = rmp_serde::from_slice(&bytes).unwrap();
            assert_eq!(v, Value::Value(Number(want)));
        }
    }

    #[test]
    fn a_whole_number_attribute_shows_a_fraction_as_written() {
        let mut f = Findings::default();
        let path = || vec![PathStep::Attr("port")];
        assert_eq!(
            whole_number(&mut f, path(), "port", &Value::Value(Number(8080.0))),
            Some(8080)
        );
        assert_eq!(
            whole_number(&mut f, path(), "port", &Value::Value(Number(-1.0))),
            Some(-1)
        );
        assert!(f.0.is_empty());
        assert_eq!(
            whole_number(&mut f, path(), "port", &Value::Value(Number(80.5))),
            None
        );
        assert_eq!(f.0[0].detail, "port must be a whole number, got 80.5.");
        assert_eq!(f.0[0].path, path());
        assert_eq!(whole_number(&mut f, path(), "port", &Value::Unknown), None);
        assert_eq!(f.0.len(), 1, "an unknown value is checked once known");
    }

    #[test]
    fn numbers_write_back_as_the_decimal_the_operator_wrote() {
        let back: String =
            rmp_serde::from_slice(&rmp_serde::to_vec(&Number(10.3)).unwrap()).unwrap();
        assert_eq!(back, "10.3");
        let whole: i64 = rmp_serde::from_slice(&rmp_serde::to_vec(&Number(80.0)).unwrap()).unwrap();
        assert_eq!(whole, 80);
    }
}
