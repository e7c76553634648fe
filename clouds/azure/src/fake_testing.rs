//! The fake ARM server for the tests of the azure driver
//! (`scripts/azure-fake.sh` starts it with TLS; the test script exports its
//! endpoint and CA), and a client of it that is independent of the driver:
//! curl, with the fake's own state dump.
//!
//! Without `LBSCALE_TEST_AZURE_ENDPOINT`, [`fake`] fails the test when
//! `CI=true` and skips it with a printed note otherwise: never a silent pass.

use crate::credentials::{Choice, ClientSecret};
use crate::AzureSettings;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;

pub const ENDPOINT_VAR: &str = "LBSCALE_TEST_AZURE_ENDPOINT";
pub const CA_VAR: &str = "LBSCALE_TEST_AZURE_CA";
pub const SUBSCRIPTION: &str = "00000000-0000-0000-0000-00000000a2be";
pub const TENANT: &str = "lbscale-test-tenant";
pub const CLIENT: &str = "lbscale-test-client";
pub const SECRET: &str = "lbscale-test-secret-value";
pub const LOCATION: &str = "westeurope";

pub struct Fake {
    pub endpoint: String,
    pub ca: PathBuf,
}

/// The fake, or None (after saying so) when the suite runs without it.
pub fn fake(test: &str) -> Option<Fake> {
    match (std::env::var(ENDPOINT_VAR), std::env::var(CA_VAR)) {
        (Ok(endpoint), Ok(ca)) => Some(Fake {
            endpoint,
            ca: ca.into(),
        }),
        _ if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("{ENDPOINT_VAR} and {CA_VAR} are not set: run the suite with scripts/test.sh")
        }
        _ => {
            eprintln!("SKIPPED {test}: {ENDPOINT_VAR} is not set (scripts/azure-fake.sh start)");
            None
        }
    }
}

/// A name no other test run uses (the fake keeps its state while it runs).
pub fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{prefix}-{}-{nanos:x}", std::process::id())
}

impl Fake {
    /// Settings that reach the fake in resource group `rg`, with a client
    /// secret (the fake is also the login endpoint).
    pub fn settings(&self, rg: &str) -> AzureSettings {
        AzureSettings {
            subscription_id: Some(SUBSCRIPTION.into()),
            resource_group: Some(rg.into()),
            location: Some(LOCATION.into()),
            endpoint: Some(self.endpoint.clone()),
            ca_bundle: Some(self.ca.clone()),
            credentials: Choice {
                client_secret: Some(ClientSecret {
                    tenant_id: TENANT.into(),
                    client_id: CLIENT.into(),
                    secret: SECRET.into(),
                }),
                authority_host: Some(self.endpoint.clone()),
                ..Choice::default()
            },
            ..AzureSettings::default()
        }
    }

    fn curl(
        &self,
        method: &str,
        path: &str,
        headers: &[String],
        body: Option<&str>,
    ) -> (u16, String) {
        let mut cmd = std::process::Command::new("curl");
        cmd.args(["-s", "--max-time", "20", "-X", method, "--cacert"])
            .arg(&self.ca)
            .args(["-w", "\n%{http_code}"]);
        for h in headers {
            cmd.args(["-H", h]);
        }
        if let Some(b) = body {
            cmd.args(["--data-binary", b]);
        }
        let out = cmd
            .arg(format!("{}{path}", self.endpoint))
            .output()
            .expect("curl");
        assert!(out.status.success(), "curl {method} {path}: {out:?}");
        let text = String::from_utf8(out.stdout).unwrap();
        let (body, code) = text.rsplit_once('\n').unwrap();
        (code.parse().unwrap(), body.to_string())
    }

    /// A control call (`/_fake/...`).
    pub fn control(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let b = body.map(|b| b.to_string());
        let (code, text) = self.curl(
            method,
            path,
            &["Content-Type: application/json".into()],
            b.as_deref(),
        );
        assert_eq!(code, 200, "{method} {path}: {text}");
        serde_json::from_str(&text).unwrap()
    }

    /// Everything the fake holds.
    pub fn state(&self) -> Value {
        self.control("GET", "/_fake/state", None)
    }

    /// What the fake's private addresses start with (`127.91.` by default).
    pub fn private_prefix(&self) -> String {
        self.state()["prefixes"]["private"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// What the fake's public addresses start with (`127.92.` by default).
    pub fn public_prefix(&self) -> String {
        self.state()["prefixes"]["public"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// The TCP relays the fake runs for public addresses: `address:port` ->
    /// the `address:port` targets it relays to (Azure's NAT, load balancer
    /// and network security groups, emulated).
    pub fn relays(&self) -> BTreeMap<String, Vec<String>> {
        serde_json::from_value(self.state()["relays"].clone()).unwrap_or_default()
    }

    /// The resource at `id` as the fake holds it, if any.
    pub fn resource(&self, id: &str) -> Option<Value> {
        self.state()["resources"]
            .get(id.to_ascii_lowercase())
            .cloned()
    }

    /// The fake's resources whose id starts with `prefix` (lower case ids).
    pub fn resources_under(&self, prefix: &str) -> BTreeMap<String, Value> {
        let p = prefix.to_ascii_lowercase();
        self.state()["resources"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| k.starts_with(&p))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Makes the next `count` calls of `method` on paths matching `path`
    /// (a regex) answer `status` (with `Retry-After: 0`).
    pub fn fail(&self, method: &str, path: &str, status: u16, count: u32) {
        self.control(
            "POST",
            "/_fake/faults",
            Some(json!({"method": method, "path": path, "status": status, "count": count, "retry_after": 0})),
        );
    }

    /// Makes the next long-running operation on a path matching `path` fail with `code`.
    pub fn fail_operation(&self, path: &str, code: &str) {
        self.control(
            "POST",
            "/_fake/faults",
            Some(json!({"kind": "operation", "method": "LRO", "path": path, "status": 500, "code": code, "count": 1})),
        );
    }

    /// The ARM calls the fake answered: (method, path, operation id, status, If-Match).
    pub fn requests(&self) -> Vec<Value> {
        self.control("GET", "/_fake/requests", None)["requests"]
            .as_array()
            .unwrap()
            .clone()
    }

    /// A token of the test's service principal, by curl.
    pub fn token(&self) -> String {
        let form = format!(
            "grant_type=client_credentials&client_id={CLIENT}&client_secret={SECRET}&scope=https%3A%2F%2Fmanagement.azure.com%2F.default"
        );
        let (code, text) = self.curl(
            "POST",
            &format!("/{TENANT}/oauth2/v2.0/token"),
            &[],
            Some(&form),
        );
        assert_eq!(code, 200, "{text}");
        serde_json::from_str::<Value>(&text).unwrap()["access_token"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// An ARM call by curl: (status, body).
    pub fn arm(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let b = body.map(|b| b.to_string());
        let (code, text) = self.curl(
            method,
            path,
            &[
                format!("Authorization: Bearer {}", self.token()),
                "Content-Type: application/json".into(),
            ],
            b.as_deref(),
        );
        (code, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// An ARM call by curl with extra `headers`: (status, answer headers in
    /// lower case, body).
    pub fn arm_raw(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        headers: &[&str],
    ) -> (u16, BTreeMap<String, String>, String) {
        let mut h: Vec<String> = vec!["Content-Type: application/json".into()];
        h.extend(headers.iter().map(|s| s.to_string()));
        let mut cmd = std::process::Command::new("curl");
        cmd.args([
            "-s",
            "--max-time",
            "20",
            "-D",
            "-",
            "-X",
            method,
            "--cacert",
        ])
        .arg(&self.ca);
        for x in &h {
            cmd.args(["-H", x]);
        }
        if let Some(b) = body {
            cmd.args(["--data-binary", b]);
        }
        let out = cmd
            .arg(format!("{}{path}", self.endpoint))
            .output()
            .expect("curl");
        let text = String::from_utf8(out.stdout).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        (status, headers, body.to_string())
    }

    /// `/subscriptions/S/resourceGroups/RG/providers/` + `rest`.
    pub fn path(rg: &str, rest: &str) -> String {
        format!("/subscriptions/{SUBSCRIPTION}/resourceGroups/{rg}/providers/{rest}")
    }

    /// A virtual network in `rg` with a subnet per zone: zone -> subnet id.
    pub fn network(&self, rg: &str, zones: &[&str]) -> BTreeMap<String, String> {
        let subnets: Vec<Value> = zones
            .iter()
            .enumerate()
            .map(|(i, z)| json!({"name": format!("zone-{z}"), "properties": {"addressPrefix": format!("10.0.{}.0/24", i + 1)}}))
            .collect();
        let path = Self::path(rg, "Microsoft.Network/virtualNetworks/lbscale-test");
        let (code, body) = self.arm(
            "PUT",
            &format!("{path}?api-version=2025-07-01"),
            Some(json!({"location": LOCATION, "properties": {"addressSpace": {"addressPrefixes": ["10.0.0.0/16"]}, "subnets": subnets}})),
        );
        assert!(code == 201 || code == 200, "{code} {body}");
        zones
            .iter()
            .map(|z| (z.to_string(), format!("{path}/subnets/zone-{z}")))
            .collect()
    }

    /// A public DNS zone in `rg`.
    pub fn dns_zone(&self, rg: &str, zone: &str) -> String {
        let path = Self::path(rg, &format!("Microsoft.Network/dnsZones/{zone}"));
        let (code, body) = self.arm(
            "PUT",
            &format!("{path}?api-version=2018-05-01"),
            Some(json!({"location": "global"})),
        );
        assert!(code == 201 || code == 200, "{code} {body}");
        path
    }
}
