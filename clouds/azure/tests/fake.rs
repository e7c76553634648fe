//! The fake ARM server itself: it refuses what Azure's definitions do not
//! allow, answers in ARM's error envelope, runs long-running operations
//! through their states, keeps ETags and injects faults. (Its answers are
//! validated by the fake itself; azure_sdk.rs checks them with Azure's own
//! clients.)

use lbscale_cloud_azure::fake_testing::{fake, unique, Fake};
use serde_json::{json, Value};

const V: &str = "api-version=2025-07-01";

fn lb(rg: &str, name: &str) -> String {
    Fake::path(rg, &format!("Microsoft.Network/loadBalancers/{name}"))
}

fn error_of(body: &str) -> (String, String) {
    let v: Value = serde_json::from_str(body).unwrap();
    (
        v["error"]["code"].as_str().unwrap().to_string(),
        v["error"]["message"].as_str().unwrap().to_string(),
    )
}

#[test]
fn requests_that_the_definitions_do_not_allow_are_refused_in_arm_s_envelope() {
    let Some(fake) =
        fake("requests_that_the_definitions_do_not_allow_are_refused_in_arm_s_envelope")
    else {
        return;
    };
    let rg = unique("rg-fake");
    let token = format!("Authorization: Bearer {}", fake.token());
    let path = format!("{}?{V}", lb(&rg, "x"));
    let put = |body: Value| fake.arm_raw("PUT", &path, Some(&body.to_string()), &[&token]);

    let (s, _, b) = put(
        json!({"location": "westeurope", "properties": {"frontendIPConfigurations": [], "colour": "red"}}),
    );
    let (code, m) = error_of(&b);
    assert_eq!((s, code.as_str()), (400, "InvalidRequestContent"), "{b}");
    assert!(
        m.contains("properties.colour") && m.contains("not a property"),
        "{m}"
    );

    let (s, _, b) =
        put(json!({"location": "westeurope", "properties": {"provisioningState": "Succeeded"}}));
    assert_eq!(s, 400);
    assert!(
        error_of(&b)
            .1
            .contains("properties.provisioningState: is read-only"),
        "{b}"
    );

    let (s, _, b) = put(
        json!({"location": "westeurope", "properties": {"probes": [{"name": "p", "properties": {"protocol": "Tcp", "port": "80"}}]}}),
    );
    assert_eq!(s, 400);
    assert!(
        error_of(&b)
            .1
            .contains("properties.probes[0].properties.port: must be an integer"),
        "{b}"
    );

    // A strict enum (the DNS record type in the path; most of ARM's body
    // enums are extensible, `modelAsString`).
    let (s, _, b) = fake.arm_raw(
        "GET",
        &format!(
            "{}?api-version=2018-05-01",
            Fake::path(&rg, "Microsoft.Network/dnsZones/z.example/WIDGET/www")
        ),
        None,
        &[&token],
    );
    assert_eq!(
        (s, error_of(&b).0.as_str()),
        (400, "InvalidParameter"),
        "{b}"
    );
    assert!(error_of(&b).1.contains("recordType"), "{b}");

    let (s, _, b) = fake.arm_raw(
        "GET",
        &format!("{}?api-version=2019-01-01", lb(&rg, "x")),
        None,
        &[&token],
    );
    assert_eq!(
        (s, error_of(&b).0.as_str()),
        (400, "InvalidApiVersionParameter"),
        "{b}"
    );
    let (s, _, b) = fake.arm_raw("GET", &lb(&rg, "x"), None, &[&token]);
    assert_eq!(
        (s, error_of(&b).0.as_str()),
        (400, "MissingApiVersionParameter"),
        "{b}"
    );
    let (s, _, b) = fake.arm_raw(
        "GET",
        &format!("{}?{V}&colour=red", lb(&rg, "x")),
        None,
        &[&token],
    );
    assert_eq!(s, 400, "{b}");
    let (s, _, b) = fake.arm_raw("GET", &path, None, &[]);
    assert_eq!(
        (s, error_of(&b).0.as_str()),
        (401, "AuthenticationFailed"),
        "{b}"
    );
    let (s, _, b) = fake.arm_raw("GET", &path, None, &["Authorization: Bearer forged"]);
    assert_eq!(
        (s, error_of(&b).0.as_str()),
        (401, "InvalidAuthenticationToken"),
        "{b}"
    );
    let (s, _, b) = fake.arm_raw("GET", &path, None, &[&token]);
    assert_eq!(
        (s, error_of(&b).0.as_str()),
        (404, "ResourceNotFound"),
        "{b}"
    );
    let (s, _, b) = fake.arm_raw(
        "GET",
        &format!("{}?{V}", Fake::path(&rg, "Microsoft.Network/widgets/w")),
        None,
        &[&token],
    );
    assert_eq!(
        (s, error_of(&b).0.as_str()),
        (404, "InvalidResourceType"),
        "{b}"
    );
    // A reference to what does not exist.
    let (s, _, b) = fake.arm_raw(
        "PUT",
        &format!("{}?{V}", Fake::path(&rg, "Microsoft.Network/networkInterfaces/nic")),
        Some(&json!({"location": "westeurope", "properties": {"ipConfigurations": [{"name": "c", "properties": {"subnet": {"id": "/subscriptions/s/resourceGroups/g/providers/Microsoft.Network/virtualNetworks/none/subnets/none"}}}]}}).to_string()),
        &[&token],
    );
    assert_eq!(
        (s, error_of(&b).0.as_str()),
        (400, "InvalidResourceReference"),
        "{b}"
    );
}

#[test]
fn long_running_operations_etags_and_faults_behave_as_azure_documents() {
    let Some(fake) = fake("long_running_operations_etags_and_faults_behave_as_azure_documents")
    else {
        return;
    };
    let rg = unique("rg-fake");
    let token = format!("Authorization: Bearer {}", fake.token());
    let path = format!("{}?{V}", lb(&rg, "l"));
    let body = json!({"location": "westeurope", "sku": {"name": "Standard"}, "properties": {}})
        .to_string();
    let (s, h, b) = fake.arm_raw("PUT", &path, Some(&body), &[&token, "If-None-Match: *"]);
    assert_eq!(s, 201, "{b}");
    let created: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(created["properties"]["provisioningState"], "Updating");
    let op = h["azure-asyncoperation"].clone();
    assert!(h.contains_key("retry-after"), "{h:?}");
    let op_path = op
        .split_once("127.0.0.1")
        .unwrap()
        .1
        .split_once('/')
        .map(|(_, p)| format!("/{p}"))
        .unwrap();
    let (_, _, first) = fake.arm_raw("GET", &op_path, None, &[&token]);
    assert_eq!(
        serde_json::from_str::<Value>(&first).unwrap()["status"],
        "InProgress"
    );
    let (_, _, second) = fake.arm_raw("GET", &op_path, None, &[&token]);
    assert_eq!(
        serde_json::from_str::<Value>(&second).unwrap()["status"],
        "Succeeded"
    );
    let (_, h, b) = fake.arm_raw("GET", &path, None, &[&token]);
    let lb: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(lb["properties"]["provisioningState"], "Succeeded");
    assert_eq!(h["etag"], lb["etag"].as_str().unwrap());

    // Exists: If-None-Match refused; a stale If-Match refused; the current one taken.
    let (s, _, b) = fake.arm_raw("PUT", &path, Some(&body), &[&token, "If-None-Match: *"]);
    assert_eq!((s, error_of(&b).0.as_str()), (412, "PreconditionFailed"));
    let (s, _, _) = fake.arm_raw(
        "PUT",
        &path,
        Some(&body),
        &[&token, "If-Match: W/\"stale\""],
    );
    assert_eq!(s, 412);
    let current = format!("If-Match: {}", lb["etag"].as_str().unwrap());
    let (s, _, b) = fake.arm_raw("PUT", &path, Some(&body), &[&token, &current]);
    assert_eq!(s, 200, "{b}");
    assert_ne!(
        serde_json::from_str::<Value>(&b).unwrap()["etag"],
        lb["etag"]
    );

    // Faults: a 429 with Retry-After, once.
    fake.fail("GET", "loadBalancers/l$", 429, 1);
    let (s, h, b) = fake.arm_raw("GET", &path, None, &[&token]);
    assert_eq!((s, error_of(&b).0.as_str()), (429, "TooManyRequests"));
    assert_eq!(h["retry-after"], "0");
    assert_eq!(fake.arm_raw("GET", &path, None, &[&token]).0, 200);

    // DELETE: 202 with Location, answered 202 until done, then 204.
    let (s, h, _) = fake.arm_raw("DELETE", &path, None, &[&token]);
    assert_eq!(s, 202);
    let loc = h["location"]
        .split_once("127.0.0.1")
        .unwrap()
        .1
        .split_once('/')
        .map(|(_, p)| format!("/{p}"))
        .unwrap();
    assert_eq!(fake.arm_raw("GET", &loc, None, &[&token]).0, 202);
    assert_eq!(fake.arm_raw("GET", &loc, None, &[&token]).0, 204);
    assert_eq!(fake.arm_raw("GET", &path, None, &[&token]).0, 404);
    // Deleting what is gone: 204.
    assert_eq!(fake.arm_raw("DELETE", &path, None, &[&token]).0, 204);
}
