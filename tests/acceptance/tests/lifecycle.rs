//! The core lifecycle under every Terraform the suite is given
//! (`LBSCALE_TERRAFORMS`, see scripts/test.sh; the pinned 1.0.3 alone without it):
//! apply with all four resources, an empty plan, import of each, a diagnostic that
//! points at the attribute, destroy. Under Terraform 1.5+ also what its users
//! write: an `import {}` block with `-generate-config-out`, and (1.6+)
//! `terraform test` on examples/tests.

use lbscale_acceptance::*;
use std::path::Path;

/// main.tf's body: a dns distributor, a group of one node, its SE group. The
/// vserver is in vserver.tf (see [`vserver`]), so that a test can take it out.
fn stack(name: &str, min: &str) -> String {
    format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
  name   = "{name}-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "{name}.lbscale.test"
  ttl    = "1s"
}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "{name}"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = 2
  drain_timeout          = "2s"
  threshold {{
    metric = "cpu"
    min    = {min} # threshold min
    max    = 80
  }}
}}

resource "lbscale_se_group" "s" {{
  name               = "{name}-se"
  autoscale_group_id = lbscale_autoscale_group.g.id
}}

output "dns" {{ value = lbscale_traffic_distributor.d.address["dns"] }}
"#
    )
}

fn vserver(name: &str, backend: u16) -> String {
    format!(
        r#"
resource "lbscale_vserver" "web" {{
  name         = "{name}-web"
  se_group_id  = lbscale_se_group.s.id
  service_type = "HTTP"
  port         = 8080
  lb_method    = "ROUNDROBIN"
  service {{
    name    = "app"
    address = "127.0.0.1"
    port    = {backend}
    weight  = 3
  }}
}}
"#
    )
}

fn write_vserver(ws: &Workspace, text: &str) {
    std::fs::write(ws.dir.join("vserver.tf"), text).unwrap();
}

/// The node's address, from the distributor's DNS answer; a request through it
/// reaches the backend.
fn assert_serves(ws: &Workspace, name: &str, backend_name: &str) -> Vec<String> {
    let dns = ws.outputs()["dns"]["value"]
        .as_str()
        .expect("dns output")
        .to_string();
    let ips = dig(&dns, &format!("{name}.lbscale.test"));
    assert_eq!(ips.len(), 1, "one node in DNS: {ips:?}");
    let (status, _, body) = http_get(&ips[0], 8080, &format!("{name}.lbscale.test"))
        .unwrap_or_else(|e| panic!("request through {}: {e}", ips[0]));
    assert_eq!((status, body.trim()), (200, backend_name));
    ips
}

fn core_lifecycle(tf: &TerraformCli, octet: u8) {
    let name = format!("life{octet}");
    let backend = http_backend("life-backend");
    let mut ws = Workspace::new(&format!("lifecycle-{}", tf.label()), octet);
    ws.terraform = tf.path.clone();
    ws.write(&stack(&name, "20"));
    write_vserver(&ws, &vserver(&name, backend));

    ws.apply();
    let ips = assert_serves(&ws, &name, "life-backend");
    ws.assert_plan_empty(&format!("create (terraform {})", tf.label()));

    for (address, id) in [
        ("lbscale_vserver.web", format!("{name}-web")),
        ("lbscale_se_group.s", format!("{name}-se")),
        ("lbscale_autoscale_group.g", name.clone()),
        ("lbscale_traffic_distributor.d", format!("{name}-dns")),
    ] {
        ws.reimport(address, &id);
    }

    // A bad value in a nested block: refused at plan, pointing at its line.
    ws.write(&stack(&name, "90"));
    let o = ws.plan();
    assert_eq!(o.code, 1, "terraform {}: {}", tf.label(), o.all());
    let line = line_of(&ws, "# threshold min");
    let diags = diagnostics(&o.all());
    assert!(
        diags.iter().any(|d| d.severity == "error"
            && d.text
                .contains("threshold[0].min: must be below max (80), got 90")
            && d.line == Some(line)),
        "terraform {}: no error at main.tf line {line}: {diags:#?}",
        tf.label()
    );
    ws.write(&stack(&name, "20"));
    ws.assert_plan_empty("the refused plan");

    ws.destroy();
    ws.assert_nothing_left(&[(ips[0].clone(), 8080)]);
}

#[test]
fn core_lifecycle_under_every_terraform() {
    let tfs = terraforms();
    eprintln!(
        "lifecycle under terraform {}",
        tfs.iter().map(|t| t.label()).collect::<Vec<_>>().join(", ")
    );
    for (i, tf) in tfs.iter().enumerate() {
        core_lifecycle(tf, 150 + i as u8);
    }
}

/// The first Terraform of the list that is at least `major.minor`; `None` (with
/// a note, or a failure when CI=true) if there is none.
fn current_terraform(major: u32, minor: u32, what: &str) -> Option<TerraformCli> {
    let found = terraforms().into_iter().find(|t| t.at_least(major, minor));
    if found.is_none() {
        let msg = format!(
            "{what} needs Terraform {major}.{minor}+ in LBSCALE_TERRAFORMS (scripts/test.sh adds \
             the `terraform` on PATH); none given"
        );
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{msg}");
        eprintln!("skipped: {msg}");
    }
    found
}

#[test]
fn import_block_with_generated_config_plans_empty() {
    let Some(tf) = current_terraform(1, 5, "an import {} block") else {
        return;
    };
    let octet = 155;
    let name = format!("life{octet}");
    let backend = http_backend("gen-backend");
    let mut ws = Workspace::new("lifecycle-import-block", octet);
    ws.terraform = tf.path.clone();
    ws.write(&stack(&name, "20"));
    write_vserver(&ws, &vserver(&name, backend));
    ws.apply();

    // Forget the vserver, then import it from an import block with no resource
    // block: Terraform writes the configuration from what the provider read.
    let o = ws.tf(&["state", "rm", "lbscale_vserver.web"]);
    assert_eq!(o.code, 0, "{}", o.all());
    std::fs::remove_file(ws.dir.join("vserver.tf")).unwrap();
    std::fs::write(
        ws.dir.join("import.tf"),
        format!("import {{\n  to = lbscale_vserver.web\n  id = \"{name}-web\"\n}}\n"),
    )
    .unwrap();
    let o = ws.tf(&[
        "plan",
        "-no-color",
        "-input=false",
        "-generate-config-out=generated.tf",
    ]);
    assert_eq!(o.code, 0, "terraform {}: {}", tf.label(), o.all());
    assert!(
        o.stdout
            .contains("1 to import, 0 to add, 0 to change, 0 to destroy"),
        "{}",
        o.stdout
    );
    let generated = std::fs::read_to_string(ws.dir.join("generated.tf")).unwrap();
    // Terraform aligns the `=` of a block's attributes: compare with runs of
    // blanks squashed, so that a new attribute's longer name changes nothing.
    let squash = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    for expected in [
        "resource \"lbscale_vserver\" \"web\"",
        &format!("name = \"{name}-web\""),
        "service_type = \"HTTP\"",
        &format!("port = {backend}"),
        "weight = 3",
    ] {
        assert!(
            squash(&generated).contains(expected),
            "generated.tf lacks {expected:?}:\n{generated}"
        );
    }
    let o = ws.tf(&["apply", "-auto-approve", "-no-color", "-input=false"]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stdout.contains("1 imported"), "{}", o.stdout);
    ws.assert_plan_empty("the import block with the generated configuration");
    // The imported vserver is the one that serves.
    assert_serves(&ws, &name, "gen-backend");

    // The generated configuration names the SE group by its literal id, so
    // Terraform knows no order between the two and destroys both at once: the
    // SE group's destroy waits for its vserver's (it would refuse at once
    // otherwise, while the vserver is still there).
    let seg = ws.resource("lbscale_se_group.s")["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        generated.lines().any(|l| {
            l.trim_start().starts_with("se_group_id") && l.ends_with(&format!("\"{seg}\""))
        }),
        "generated.tf names the SE group by its id:\n{generated}"
    );
    ws.destroy();
    ws.assert_nothing_left(&[]);
}

#[test]
fn terraform_test_asserts_on_the_data_source() {
    let Some(tf) = current_terraform(1, 6, "terraform test") else {
        return;
    };
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tests");
    let ws = {
        let mut ws = Workspace::new("lifecycle-tftest", 156);
        ws.terraform = tf.path.clone();
        ws
    };
    let mut copied = 0;
    for f in std::fs::read_dir(&example).unwrap().flatten() {
        let n = f.file_name().to_string_lossy().into_owned();
        if n.ends_with(".tf") || n.ends_with(".tftest.hcl") {
            std::fs::copy(f.path(), ws.dir.join(&n)).unwrap();
            copied += 1;
        }
    }
    assert!(copied >= 2, "examples/tests has main.tf and a .tftest.hcl");
    let prefix = format!("-var=address_prefix={}", ws.prefix);
    let o = ws.tf(&["test", "-no-color", &prefix]);
    assert_eq!(o.code, 0, "terraform {} test:\n{}", tf.label(), o.all());
    assert!(o.stdout.contains("1 passed, 0 failed"), "{}", o.stdout);
    ws.assert_nothing_left(&[]);

    // The assertions can fail: the same test, asking for a node count the group
    // does not have, fails with the test's own message.
    for f in std::fs::read_dir(&ws.dir).unwrap().flatten() {
        let p = f.path();
        if p.to_string_lossy().ends_with(".tftest.hcl") {
            let text = std::fs::read_to_string(&p).unwrap();
            let asked = "node_count == 2 * var.min_nodes";
            assert!(text.contains(asked), "{text}");
            std::fs::write(
                &p,
                text.replace(asked, "node_count == 2 * var.min_nodes + 1"),
            )
            .unwrap();
        }
    }
    let o = ws.tf(&["test", "-no-color", &prefix]);
    assert_eq!(o.code, 1, "{}", o.all());
    let text = diagnostics(&o.all())
        .into_iter()
        .map(|d| d.text)
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        text.contains("every AZ has its min_nodes serving: 2 nodes serve in 2 AZs"),
        "{}",
        o.all()
    );
    ws.assert_nothing_left(&[]);
}

#[test]
fn an_unknown_terraform_in_the_list_says_what_to_do() {
    let what_to_do = "fix LBSCALE_TERRAFORMS (colon-separated paths of Terraform binaries) \
                      or unset it to test the pinned Terraform only";
    let pinned = terraform().display().to_string();
    let e = terraforms_from(Some(&format!("{pinned}:/nonexistent/terraform"))).unwrap_err();
    assert!(
        e.starts_with("LBSCALE_TERRAFORMS: cannot run /nonexistent/terraform: ")
            && e.ends_with(what_to_do),
        "{e}"
    );
    let e = terraforms_from(Some("/bin/true")).unwrap_err();
    assert_eq!(
        e,
        format!(
            "LBSCALE_TERRAFORMS: /bin/true is not a Terraform CLI (`version -json` gave no \
             terraform_version); {what_to_do}"
        )
    );
    // Unset or empty: the pinned Terraform alone.
    for list in [None, Some("")] {
        let tfs = terraforms_from(list).unwrap();
        assert_eq!(tfs.len(), 1);
        assert_eq!(tfs[0].path, terraform());
    }
}
