//! The aws block's credential settings under the real Terraform CLI, against
//! moto (whose STS records every role session it hands out, with its external
//! ID): `assume_role` over the block's keys, a `profile` of the shared config
//! files whose role is assumed over its `source_profile`, and bad values
//! refused at plan time on their attribute.

use lbscale_acceptance::*;
use lbscale_cloud_aws::moto_testing::{moto, unique, Moto};

const SECRET: &str = "acceptance-credentials-secret";

fn distributor(name: &str, domain: &str) -> String {
    format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
  name   = "{name}"
  cloud  = "aws"
  mode   = "dns"
  domain = "{domain}"
}}
"#
    )
}

/// The role sessions moto handed out named `session`: (role ARN, external ID).
fn sessions(moto: &Moto, session: &str) -> Vec<(String, String)> {
    moto.state()["sts"]["AssumedRole"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|r| r["session_name"] == session)
        .map(|r| {
            (
                r["role_arn"].as_str().unwrap_or_default().to_string(),
                r["external_id"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

#[test]
fn the_aws_block_assumes_its_role_and_refuses_bad_ones_by_attribute() {
    let Some(moto) = moto("the_aws_block_assumes_its_role_and_refuses_bad_ones_by_attribute")
    else {
        return;
    };
    let mut ws = Workspace::new("aws-assume-role", 187);
    let session = unique("tf");
    let block = |role: &str, extra: &str| {
        format!(
            r#"  aws {{
    region      = "us-east-1"
    endpoint    = "{}"
    credentials = "AKIDACCEPTANCE:{SECRET}"
    ca_bundle   = "{}"
    assume_role {{
      role_arn     = "{role}"
      external_id  = "lbscale-acceptance"
      session_name = "{session}"
{extra}    }}
  }}
"#,
            moto.endpoint,
            moto.ca.display()
        )
    };
    let role = "arn:aws:iam::123456789012:role/lbscale-terraform";
    let name = unique("awsr");
    let stack = distributor(&name, &format!("{}.lbscale.test", unique("role")));

    // Bad values: refused at plan time on their attribute, before any call.
    ws.provider_blocks = block("arn:aws:iam::42:role/short-account", "");
    ws.write(&stack);
    let o = ws.plan();
    assert_eq!(o.code, 1, "{}", o.all());
    let d = diagnostics(&o.all());
    assert!(
        d.iter().any(|d| d.summary == "Invalid role_arn"
            && d.text.contains("arn:aws:iam::ACCOUNT:role/NAME")
            && d.line == Some(line_of(&ws, "role_arn "))),
        "{d:?}"
    );
    ws.provider_blocks = block(role, "      duration     = \"5m\"\n");
    ws.write(&stack);
    let o = ws.plan();
    assert_eq!(o.code, 1, "{}", o.all());
    let d = diagnostics(&o.all());
    assert!(
        d.iter().any(|d| d.summary == "Invalid duration"
            && d.text.contains("between 15m and 12h")
            && d.line == Some(line_of(&ws, "duration "))),
        "{d:?}"
    );
    assert!(sessions(&moto, &session).is_empty(), "no role assumed yet");

    // A good one: every call goes through the role's session.
    ws.provider_blocks = block(role, "      duration     = \"1h\"\n");
    ws.write(&stack);
    ws.apply();
    let got = sessions(&moto, &session);
    assert!(!got.is_empty(), "the provider assumed no role");
    assert!(
        got.iter()
            .all(|(arn, ext)| arn == role && ext == "lbscale-acceptance"),
        "{got:?}"
    );
    ws.assert_plan_empty("applying with assume_role");
    let state = std::fs::read_to_string(ws.dir.join("terraform.tfstate")).unwrap();
    assert!(!state.contains(SECRET), "the AWS secret is in the state");
    ws.destroy();
}

#[test]
fn the_aws_block_takes_a_profile_of_the_shared_config_files() {
    let Some(moto) = moto("the_aws_block_takes_a_profile_of_the_shared_config_files") else {
        return;
    };
    let ws = Workspace::new("aws-profile", 188);
    let session = unique("profile");
    let role = "arn:aws:iam::123456789012:role/lbscale-profile";
    let config = ws.dir.join("aws-config");
    let credentials = ws.dir.join("aws-credentials");
    std::fs::write(
        &config,
        format!(
            "[profile lbscale]\nregion = us-east-1\nrole_arn = {role}\nsource_profile = keys\nexternal_id = from-profile\nrole_session_name = {session}\n"
        ),
    )
    .unwrap();
    std::fs::write(
        &credentials,
        format!("[keys]\naws_access_key_id = AKIDPROFILE\naws_secret_access_key = {SECRET}\n"),
    )
    .unwrap();
    let mut ws = ws;
    // No region and no keys in the block: both come from the profile.
    ws.provider_blocks = format!(
        r#"  aws {{
    endpoint  = "{}"
    ca_bundle = "{}"
    profile   = "lbscale"
  }}
"#,
        moto.endpoint,
        moto.ca.display()
    );
    let name = unique("awsp");
    ws.write(&distributor(
        &name,
        &format!("{}.lbscale.test", unique("prof")),
    ));
    let env = [
        ("AWS_CONFIG_FILE", config.to_str().unwrap()),
        ("AWS_SHARED_CREDENTIALS_FILE", credentials.to_str().unwrap()),
        // Keys in the environment do not win over a profile the block names.
        ("AWS_ACCESS_KEY_ID", "AKIDFROMENV"),
        ("AWS_SECRET_ACCESS_KEY", "env-secret"),
        ("AWS_REGION", ""),
        ("AWS_DEFAULT_REGION", ""),
    ];
    let o = ws.tf_env(
        &["apply", "-auto-approve", "-no-color", "-input=false"],
        &env,
    );
    assert_eq!(o.code, 0, "terraform apply failed:\n{}", o.all());
    let got = sessions(&moto, &session);
    assert!(
        !got.is_empty()
            && got
                .iter()
                .all(|(arn, ext)| arn == role && ext == "from-profile"),
        "{got:?}"
    );

    // A profile that is not in the files: the cloud is refused by name.
    let o = ws.tf_env(&["plan", "-no-color", "-input=false"], &env);
    assert_eq!(o.code, 0, "{}", o.all());
    let missing = [
        ("AWS_CONFIG_FILE", "/nonexistent/lbscale/config"),
        (
            "AWS_SHARED_CREDENTIALS_FILE",
            "/nonexistent/lbscale/credentials",
        ),
        ("AWS_REGION", "us-east-1"),
    ];
    let o = ws.tf_env(&["plan", "-no-color", "-input=false"], &missing);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(
        o.all().contains("no AWS profile \"lbscale\""),
        "{}",
        o.all()
    );
    let o = ws.tf_env(
        &["destroy", "-auto-approve", "-no-color", "-input=false"],
        &env,
    );
    assert_eq!(o.code, 0, "terraform destroy failed:\n{}", o.all());
}
