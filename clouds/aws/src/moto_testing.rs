//! moto's server for the tests of the aws driver (scripts/moto.sh starts it
//! with TLS; scripts/test.sh exports its endpoint and CA), and a client of it
//! that is independent of the driver: curl, with moto's own state dump.
//!
//! Without `LBSCALE_TEST_AWS_ENDPOINT`, [`moto`] fails the test when `CI=true`
//! and skips it with a printed note otherwise: never a silent pass.

use crate::{sigv4::Credentials, AwsSettings};
use serde_json::Value;
use std::path::PathBuf;

pub const ENDPOINT_VAR: &str = "LBSCALE_TEST_AWS_ENDPOINT";
pub const CA_VAR: &str = "LBSCALE_TEST_AWS_CA";

pub struct Moto {
    pub endpoint: String,
    pub ca: PathBuf,
}

/// The test server, or None (after saying so) when the suite runs without it.
pub fn moto(test: &str) -> Option<Moto> {
    match (std::env::var(ENDPOINT_VAR), std::env::var(CA_VAR)) {
        (Ok(endpoint), Ok(ca)) => Some(Moto {
            endpoint,
            ca: ca.into(),
        }),
        _ if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("{ENDPOINT_VAR} and {CA_VAR} are not set: run the suite with scripts/test.sh")
        }
        _ => {
            eprintln!("SKIPPED {test}: {ENDPOINT_VAR} is not set (scripts/moto.sh start)");
            None
        }
    }
}

impl Moto {
    /// Settings that reach moto (no image: tests name their own).
    pub fn settings(&self) -> AwsSettings {
        AwsSettings {
            region: Some("us-east-1".into()),
            endpoint: Some(self.endpoint.clone()),
            credentials: Some(Credentials {
                access_key_id: "AKIDLBSCALETEST".into(),
                secret_access_key: "test-secret-key".into(),
                session_token: None,
            }),
            ca_bundle: Some(self.ca.clone()),
            ..AwsSettings::default()
        }
    }

    /// Everything moto holds, as its `/moto-api/data.json` shows it.
    /// moto cannot write its state out while any security group has rules
    /// (a 500: "SecurityGroupRule is not JSON serializable"), which another
    /// test's group may have for a moment: tried for up to 30 s.
    pub fn state(&self) -> Value {
        let mut last = None;
        for _ in 0..30 {
            let out = std::process::Command::new("curl")
                .args(["-sf", "--max-time", "10", "--cacert"])
                .arg(&self.ca)
                .arg(format!("{}/moto-api/data.json", self.endpoint))
                .output()
                .expect("curl");
            if out.status.success() {
                return serde_json::from_slice(&out.stdout).expect("moto's state is JSON");
            }
            last = Some(out);
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
        panic!("curl data.json, for 30 s: {last:?}")
    }

    pub fn instance(&self, id: &str) -> Value {
        self.state()["ec2"]["Instance"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no instance {id} in moto"))
    }

    /// A call to moto with curl, a client independent of the driver (moto does
    /// not check signatures; the header names the service).
    pub fn call(&self, service: &str, method: &str, path: &str, body: Option<&str>) -> String {
        let mut cmd = std::process::Command::new("curl");
        cmd.args(["-s", "--max-time", "10", "-X", method, "--cacert"])
            .arg(&self.ca)
            .args([
                "-H",
                &format!("Authorization: AWS4-HMAC-SHA256 Credential=AKIDLBSCALETEST/20260101/us-east-1/{service}/aws4_request, SignedHeaders=host, Signature=0"),
            ]);
        if let Some(b) = body {
            let ct = if b.starts_with('<') {
                "text/xml"
            } else {
                "application/x-www-form-urlencoded"
            };
            cmd.args(["-H", &format!("Content-Type: {ct}"), "--data", b]);
        }
        let out = cmd
            .arg(format!("{}{path}", self.endpoint))
            .output()
            .expect("curl");
        assert!(out.status.success(), "curl {method} {path}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    /// The hosted zones: (id, name with its final dot, caller reference).
    pub fn zones(&self) -> Vec<(String, String, String)> {
        let xml = self.call("route53", "GET", "/2013-04-01/hostedzone", None);
        let doc = roxmltree::Document::parse(&xml).unwrap();
        doc.descendants()
            .filter(|n| n.has_tag_name("HostedZone"))
            .map(|z| {
                let t = |name: &str| {
                    z.children()
                        .find(|c| c.has_tag_name(name))
                        .and_then(|c| c.text())
                        .unwrap_or("")
                        .to_string()
                };
                (
                    t("Id").trim_start_matches("/hostedzone/").to_string(),
                    t("Name"),
                    t("CallerReference"),
                )
            })
            .collect()
    }

    /// The A records named `name` (with its final dot) in the zone named
    /// `zone` (with its final dot), as (TTL, sorted values).
    pub fn a_records(&self, zone: &str, name: &str) -> Vec<(String, Vec<String>)> {
        let Some((id, _, _)) = self.zones().into_iter().find(|z| z.1 == zone) else {
            return vec![];
        };
        let xml = self.call(
            "route53",
            "GET",
            &format!("/2013-04-01/hostedzone/{id}/rrset"),
            None,
        );
        let doc = roxmltree::Document::parse(&xml).unwrap();
        doc.descendants()
            .filter(|n| n.has_tag_name("ResourceRecordSet"))
            .filter(|r| {
                let t = |n: &str| {
                    r.children()
                        .find(|c| c.has_tag_name(n))
                        .and_then(|c| c.text())
                };
                t("Type") == Some("A") && t("Name") == Some(name)
            })
            .map(|r| {
                let ttl = r
                    .children()
                    .find(|c| c.has_tag_name("TTL"))
                    .and_then(|c| c.text())
                    .unwrap_or("")
                    .to_string();
                let mut values: Vec<String> = r
                    .descendants()
                    .filter(|v| v.has_tag_name("Value"))
                    .filter_map(|v| v.text().map(str::to_string))
                    .collect();
                values.sort();
                (ttl, values)
            })
            .collect()
    }

    /// The instance's user data, decoded.
    pub fn user_data(&self, instance: &str) -> String {
        let xml = self.call(
            "ec2",
            "POST",
            "/",
            Some(&format!("Action=DescribeInstanceAttribute&Version=2016-11-15&InstanceId={instance}&Attribute=userData")),
        );
        let doc = roxmltree::Document::parse(&xml).unwrap();
        let b64 = doc
            .descendants()
            .find(|n| n.has_tag_name("userData"))
            .and_then(|u| u.descendants().find(|n| n.has_tag_name("value")))
            .and_then(|v| v.text())
            .unwrap_or_else(|| panic!("no user data: {xml}"));
        use base64::Engine as _;
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .unwrap(),
        )
        .unwrap()
    }
}

/// A name no other test run uses (moto keeps its state while it runs).
pub fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{prefix}-{}-{nanos:x}", std::process::id())
}
