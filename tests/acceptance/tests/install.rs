//! The provider installed as users install any provider: scripts/package-provider.sh
//! packages the built binaries as a registry release into a filesystem mirror, and
//! `terraform init` installs it from there (offline), writing the lock file; plan,
//! apply and destroy then run the installed copy. Under every Terraform of
//! `LBSCALE_TERRAFORMS`.

use lbscale_acceptance::*;
use lbscale_cloud_aws::sigv4::sha256_hex;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The provider's version: the workspace's, which this crate shares.
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// scripts/package-provider.sh on the binaries in `bin`, into `out/mirror` and
/// `out/dist`.
fn package(bin: &Path, out: &Path) -> Output {
    let mut cmd = Command::new(repo().join("scripts/package-provider.sh"));
    cmd.arg("--bin-dir")
        .arg(bin)
        .arg("--mirror")
        .arg(out.join("mirror"))
        .arg("--dist")
        .arg(out.join("dist"));
    // --bin-dir builds nothing: a few seconds of zipping.
    let o = output_within(
        &mut cmd,
        Duration::from_secs(300),
        "scripts/package-provider.sh",
    );
    Output {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lbscale-install-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn zip_name() -> String {
    format!("terraform-provider-lbscale_{}_linux_amd64.zip", version())
}

fn base64(bytes: &[u8]) -> String {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().fold(0u32, |n, b| n << 8 | *b as u32) << (8 * (3 - chunk.len()));
        for i in 0..4 {
            out.push(if i <= chunk.len() {
                A[(n >> (18 - 6 * i) & 63) as usize] as char
            } else {
                '='
            });
        }
    }
    out
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Terraform's `h1:` hash of a package holding these files (name, contents):
/// the SHA-256 of the sorted lines "SHA256HEX  NAME\n", in base64.
fn h1(files: &[(&str, PathBuf)]) -> String {
    let mut files: Vec<_> = files.to_vec();
    files.sort_by(|a, b| a.0.cmp(b.0));
    let lines: String = files
        .iter()
        .map(|(name, path)| format!("{}  {name}\n", sha256_hex(&std::fs::read(path).unwrap())))
        .collect();
    format!("h1:{}", base64(&unhex(&sha256_hex(lines.as_bytes()))))
}

/// The hashes that the lock file records for lbscale/lbscale.
fn locked_hashes(ws: &Workspace) -> Vec<String> {
    let lock = std::fs::read_to_string(ws.dir.join(".terraform.lock.hcl"))
        .expect("terraform init writes .terraform.lock.hcl");
    assert!(
        lock.contains("provider \"registry.terraform.io/lbscale/lbscale\"")
            && lock.contains(&format!("version = \"{}\"", version())),
        "{lock}"
    );
    lock.lines()
        .map(|l| l.trim().trim_end_matches(',').trim_matches('"'))
        .filter(|l| l.starts_with("h1:") || l.starts_with("zh:"))
        .map(str::to_string)
        .collect()
}

fn write_lock(ws: &Workspace, hashes: &[String]) {
    let hashes: String = hashes.iter().map(|h| format!("    \"{h}\",\n")).collect();
    std::fs::write(
        ws.dir.join(".terraform.lock.hcl"),
        format!(
            "provider \"registry.terraform.io/lbscale/lbscale\" {{\n  version = \"{}\"\n  hashes = [\n{hashes}  ]\n}}\n",
            version()
        ),
    )
    .unwrap();
}

/// Terraform's diagnostics, whitespace collapsed (it wraps lines at 78 columns).
fn diag_text(o: &Output) -> String {
    diagnostics(&o.all())
        .into_iter()
        .map(|d| d.text)
        .collect::<Vec<_>>()
        .join("\n")
}

fn init(ws: &Workspace) -> Output {
    let _ = std::fs::remove_dir_all(ws.dir.join(".terraform"));
    ws.tf(&["init", "-no-color", "-input=false"])
}

const SMALL: &str = r#"
resource "lbscale_traffic_distributor" "d" {
  name   = "inst-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "inst.lbscale.test"
  ttl    = "1s"
}

resource "lbscale_autoscale_group" "g" {
  name                   = "inst"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = 1
  threshold {
    metric = "cpu"
    min    = 10
    max    = 80
  }
}
"#;

fn installs_and_runs(tf: &TerraformCli, octet: u8) {
    let out = scratch(&tf.label());
    let o = package(&bin_dir(), &out);
    assert_eq!(o.code, 0, "package-provider.sh failed:\n{}", o.all());
    let dist = out.join("dist");
    let zip = dist.join(zip_name());
    assert_eq!(
        o.stdout.trim(),
        zip.canonicalize().unwrap().display().to_string()
    );

    // The release files: SHA256SUMS is the zip's SHA-256; the manifest says protocol 6.
    let zip_sha = sha256_hex(&std::fs::read(&zip).unwrap());
    let sums = std::fs::read_to_string(dist.join(format!(
        "terraform-provider-lbscale_{}_SHA256SUMS",
        version()
    )))
    .unwrap();
    assert!(
        sums.lines()
            .any(|l| l == format!("{zip_sha}  {}", zip_name())),
        "{sums}"
    );
    for manifest in [
        "terraform-registry-manifest.json".to_string(),
        format!("terraform-provider-lbscale_{}_manifest.json", version()),
    ] {
        let m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dist.join(&manifest)).unwrap()).unwrap();
        assert_eq!(
            m,
            serde_json::json!({"version": 1, "metadata": {"protocol_versions": ["6.0"]}}),
            "{manifest}"
        );
    }
    let mirrored = out
        .join("mirror/registry.terraform.io/lbscale/lbscale")
        .join(zip_name());
    assert_eq!(sha256_hex(&std::fs::read(&mirrored).unwrap()), zip_sha);

    let mut ws = Workspace::new(&format!("install-{}", tf.label()), octet);
    ws.terraform = tf.path.clone();
    ws.use_mirror(&out.join("mirror"));
    ws.write(SMALL);

    // terraform init from the mirror: the lock pins the build we packaged.
    let o = init(&ws);
    assert_eq!(o.code, 0, "terraform {} init:\n{}", tf.label(), o.all());
    assert!(
        o.stdout
            .contains(&format!("Installed lbscale/lbscale v{}", version())),
        "{}",
        o.stdout
    );
    let expected_h1 = h1(&[
        (
            &format!("terraform-provider-lbscale_v{}", version()),
            bin_dir().join("terraform-provider-lbscale"),
        ),
        ("lbscale-node", bin_dir().join("lbscale-node")),
    ]);
    assert_eq!(locked_hashes(&ws), vec![expected_h1.clone()]);

    // A lock holding the zip's SHA-256 (zh:, as a registry's SHA256SUMS gives
    // it): Terraform checks the mirror's zip against it and keeps it.
    write_lock(&ws, &[format!("zh:{zip_sha}")]);
    let o = init(&ws);
    assert_eq!(o.code, 0, "terraform {} init:\n{}", tf.label(), o.all());
    let mut locked = locked_hashes(&ws);
    locked.sort();
    assert_eq!(locked, vec![expected_h1, format!("zh:{zip_sha}")]);

    // plan, apply and destroy run the installed copy, with the lbscale-node
    // that came in the same zip.
    let o = ws.apply();
    assert!(
        !o.all().contains("Provider development overrides"),
        "no dev_overrides: {}",
        o.all()
    );
    let installed = ws
        .dir
        .join(".terraform/providers/registry.terraform.io/lbscale/lbscale")
        .join(version())
        .join("linux_amd64");
    let node = installed.join("lbscale-node").display().to_string();
    assert!(
        ws.processes().iter().any(|(_, cmd)| cmd.starts_with(&node)),
        "the node runs the installed {node}: {:?}",
        ws.processes()
    );
    assert_eq!(ws.resource("lbscale_autoscale_group.g")["node_count"], 1);
    ws.assert_plan_empty("apply from the mirror");
    ws.destroy();
    ws.assert_nothing_left(&[]);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn init_installs_the_packaged_provider_from_a_mirror() {
    for (i, tf) in terraforms().iter().enumerate() {
        installs_and_runs(tf, 158 + i as u8);
    }
}

#[test]
fn a_missing_mirror_or_a_wrong_hash_stops_init() {
    let tf = &terraforms()[0];
    let out = scratch("bad");
    let mut ws = Workspace::new("install-bad", 157);
    ws.terraform = tf.path.clone();
    ws.write(SMALL);

    // No mirror where the CLI configuration says.
    let missing = out.join("no-mirror");
    ws.use_mirror(&missing);
    let o = init(&ws);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(
        diag_text(&o).contains(&format!("cannot search {}", missing.display())),
        "the error names the missing mirror: {}",
        o.all()
    );

    // The build the lock pinned, then another build of the same version in the
    // mirror (a byte more in lbscale-node): init refuses it.
    let o = package(&bin_dir(), &out);
    assert_eq!(o.code, 0, "{}", o.all());
    ws.use_mirror(&out.join("mirror"));
    let o = init(&ws);
    assert_eq!(o.code, 0, "{}", o.all());
    let pinned = locked_hashes(&ws);
    let other = out.join("other-build");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::copy(
        bin_dir().join("terraform-provider-lbscale"),
        other.join("terraform-provider-lbscale"),
    )
    .unwrap();
    let mut node = std::fs::read(bin_dir().join("lbscale-node")).unwrap();
    node.push(0);
    std::fs::write(other.join("lbscale-node"), node).unwrap();
    std::fs::set_permissions(
        other.join("lbscale-node"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let o = package(&other, &out);
    assert_eq!(o.code, 0, "{}", o.all());
    let o = init(&ws);
    assert_eq!(o.code, 1, "{}", o.all());
    let mismatch =
        "doesn't match any of the checksums previously recorded in the dependency lock file";
    assert!(diag_text(&o).contains(mismatch), "{}", o.all());
    assert_eq!(locked_hashes(&ws), pinned, "a refused init keeps the lock");

    // A lock whose zh: is not the zip's SHA-256 is refused too.
    write_lock(&ws, &[format!("zh:{}", "0".repeat(64))]);
    let o = init(&ws);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(diag_text(&o).contains(mismatch), "{}", o.all());
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn package_provider_says_what_to_do_without_binaries() {
    let out = scratch("nobin");
    let o = package(&out.join("empty"), &out);
    assert_eq!(o.code, 1, "{}", o.all());
    let last = o.stderr.trim_end().lines().last().unwrap_or_default();
    assert!(
        last.starts_with("package-provider: error: ")
            && last.contains("terraform-provider-lbscale is missing: build it first (cargo build --workspace --bins)"),
        "{}",
        o.stderr
    );
    let o = Command::new(repo().join("scripts/package-provider.sh"))
        .arg("--bogus")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("unknown argument --bogus (try --help)"),
        "{o:?}"
    );
    let _ = std::fs::remove_dir_all(&out);
}
