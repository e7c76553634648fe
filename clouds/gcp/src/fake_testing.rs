//! The gcp fake (clouds/gcp/fake, started by scripts/gcp-fake.sh) for the
//! tests of the driver and of the programs that embed it: each [`GcpFake`]
//! is a fake of its own (own port, own state, own service-account key),
//! stopped when it is dropped. What the driver did is read back with curl
//! from the fake's state and API, or with Google's own gcloud, not through
//! the driver.

use crate::GcpSettings;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The project the fake serves.
pub const PROJECT: &str = "lbscale-test";
/// The image the fake knows from the start.
pub const IMAGE: &str = "projects/lbscale-test/global/images/lbscale-node";

pub struct GcpFake {
    pub endpoint: String,
    pub ca: PathBuf,
    /// Its service-account key (JSON file), whose token_uri is the fake.
    pub key: PathBuf,
    /// Its metadata server, `127.0.0.1:PORT`.
    pub metadata: String,
    dir: PathBuf,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

impl GcpFake {
    /// Starts a fake of its own for `test`. Only python3, curl and openssl are needed.
    pub fn start(test: &str) -> GcpFake {
        GcpFake::start_with(test, None)
    }

    /// As [`GcpFake::start`]; with `node_bin` (a directory holding
    /// `lbscale-node`), an instance in a loopback subnetwork runs its
    /// startup script as its boot would (see scripts/gcp-fake.sh).
    pub fn start_with(test: &str, node_bin: Option<&Path>) -> GcpFake {
        let dir =
            std::env::temp_dir().join(format!("lbscale-gcp-fake-{test}-{}", std::process::id()));
        let script = root().join("scripts/gcp-fake.sh");
        let run = |cmd: &str| -> String {
            let out = Command::new(&script)
                .arg(cmd)
                .env("LBSCALE_GCP_FAKE_DIR", &dir)
                .env("LBSCALE_FAKE_TRAFFIC_LOG", dir.join("traffic.jsonl"))
                .env(
                    "LBSCALE_GCP_FAKE_NODE_BIN",
                    node_bin.map(|p| p.as_os_str()).unwrap_or_default(),
                )
                .output()
                .expect("scripts/gcp-fake.sh");
            assert!(
                out.status.success(),
                "gcp-fake.sh {cmd}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap().trim().to_string()
        };
        let endpoint = run("start");
        GcpFake {
            endpoint,
            ca: run("ca").into(),
            key: run("key").into(),
            metadata: run("metadata"),
            dir,
        }
    }

    /// Settings that reach the fake with its service-account key.
    pub fn settings(&self) -> GcpSettings {
        GcpSettings {
            project: Some(PROJECT.into()),
            endpoint: Some(self.endpoint.clone()),
            credentials: Some(self.key.display().to_string()),
            ca_bundle: Some(self.ca.clone()),
            // No chain: nothing of the caller's environment is read.
            env: [("HOME".to_string(), "/nonexistent".to_string())].into(),
            ..GcpSettings::default()
        }
    }

    /// A call to the fake with curl (`path` from the root, e.g. `/_fake/state`).
    pub fn curl(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        token: Option<&str>,
    ) -> (u16, Value) {
        let mut cmd = Command::new("curl");
        cmd.args([
            "-s",
            "--max-time",
            "40",
            "-w",
            "\n%{http_code}",
            "-X",
            method,
            "--cacert",
        ])
        .arg(&self.ca);
        if let Some(t) = token {
            cmd.args(["-H", &format!("Authorization: Bearer {t}")]);
        }
        if let Some(b) = body {
            cmd.args([
                "-H",
                "Content-Type: application/json",
                "--data",
                &b.to_string(),
            ]);
        }
        let out = cmd
            .arg(format!("{}{path}", self.endpoint))
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (
            code.parse().unwrap_or(0),
            serde_json::from_str(body).unwrap_or(Value::Null),
        )
    }

    /// The booted instances' directories (`instances/ZONE/NAME`: boot.sh, node.log).
    pub fn instance_dir(&self, zone: &str, name: &str) -> PathBuf {
        self.dir.join("instances").join(zone).join(name)
    }

    /// Everything the fake holds.
    pub fn state(&self) -> Value {
        self.curl("POST", "/_fake/state", None, None).1
    }

    /// A token the fake accepts (for curl and gcloud).
    pub fn token(&self) -> String {
        self.curl("POST", "/_fake/token", None, None).1["access_token"]
            .as_str()
            .expect("a token")
            .to_string()
    }

    /// The next `times` calls of `method` (a discovery id) fail with `status` and `reason`.
    pub fn fail(&self, method: &str, status: u16, reason: &str, times: u32) {
        let (code, _) = self.curl(
            "POST",
            "/_fake/faults",
            Some(&serde_json::json!({"method": method, "status": status, "reason": reason, "times": times})),
            None,
        );
        assert_eq!(code, 200);
    }

    /// Tokens live `token_lifetime` seconds; operations take `operation_delay`.
    pub fn configure(&self, config: Value) {
        assert_eq!(
            self.curl("POST", "/_fake/config", Some(&config), None).0,
            200
        );
    }

    /// A Compute or DNS API call with a token of the fake (`path` from the root).
    pub fn api(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let t = self.token();
        self.curl(method, path, body, Some(&t))
    }

    /// Adds subnetwork `name` with `range` to `region`.
    pub fn subnetwork(&self, region: &str, name: &str, range: &str) {
        let body = serde_json::json!({"region": region, "name": name, "range": range});
        assert_eq!(
            self.curl("POST", "/_fake/subnetworks", Some(&body), None).0,
            200
        );
    }

    /// Makes managed zone `name` for `dns_name` (with its final dot).
    pub fn managed_zone(&self, name: &str, dns_name: &str) {
        let (code, v) = self.api(
            "POST",
            &format!("/dns/v1/projects/{PROJECT}/managedZones"),
            Some(&serde_json::json!({"name": name, "dnsName": dns_name, "description": "test"})),
        );
        assert_eq!(code, 200, "{v}");
    }

    /// The record sets of managed zone `zone`: (name, type) -> (ttl, sorted rrdatas).
    pub fn records(
        &self,
        zone: &str,
    ) -> std::collections::BTreeMap<(String, String), (u64, Vec<String>)> {
        self.state()["rrsets"][zone]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                let mut v: Vec<String> = r["rrdatas"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_str().unwrap().to_string())
                    .collect();
                v.sort();
                (
                    (
                        r["name"].as_str().unwrap().to_string(),
                        r["type"].as_str().unwrap().to_string(),
                    ),
                    (r["ttl"].as_u64().unwrap(), v),
                )
            })
            .collect()
    }

    /// The methods called so far, in order, and their statuses (the fake's traffic log).
    pub fn calls(&self) -> Vec<(String, u16)> {
        let Ok(text) = std::fs::read_to_string(self.dir.join("traffic.jsonl")) else {
            return vec![];
        };
        text.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .map(|v| {
                (
                    v["method"].as_str().unwrap_or("").to_string(),
                    v["status"].as_u64().unwrap_or(0) as u16,
                )
            })
            .collect()
    }

    /// A gcloud command against the fake (its own configuration directory,
    /// a token of the fake, the endpoint overrides and the fake's CA): its
    /// status, standard output and error.
    pub fn gcloud(&self, args: &[&str]) -> (bool, String, String) {
        let config = self.dir.join("gcloud");
        std::fs::create_dir_all(&config).unwrap();
        let token = config.join("token");
        std::fs::write(&token, self.token()).unwrap();
        let out = Command::new("gcloud")
            .args(args)
            .env("CLOUDSDK_CONFIG", &config)
            .env("CLOUDSDK_CORE_PROJECT", PROJECT)
            .env("CLOUDSDK_AUTH_ACCESS_TOKEN_FILE", &token)
            .env(
                "CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE",
                format!("{}/compute/v1/", self.endpoint),
            )
            .env(
                "CLOUDSDK_API_ENDPOINT_OVERRIDES_DNS",
                format!("{}/dns/v1/", self.endpoint),
            )
            .env("CLOUDSDK_CORE_CUSTOM_CA_CERTS_FILE", &self.ca)
            // requests (under gcloud) prefers this over gcloud's own setting.
            .env("REQUESTS_CA_BUNDLE", &self.ca)
            .env("CLOUDSDK_CORE_DISABLE_PROMPTS", "1")
            .env("CLOUDSDK_CORE_DISABLE_USAGE_REPORTING", "1")
            .env("CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK", "1")
            .output()
            .expect("gcloud (the Google Cloud CLI) is on the machine image");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

impl Drop for GcpFake {
    fn drop(&mut self) {
        let _ = Command::new(root().join("scripts/gcp-fake.sh"))
            .arg("stop")
            .env("LBSCALE_GCP_FAKE_DIR", &self.dir)
            .status();
    }
}
