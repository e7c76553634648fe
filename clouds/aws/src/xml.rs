//! Reading AWS's XML answers: the few lookups the driver needs, by local
//! element name (the namespaces differ per API and version and carry nothing
//! the driver needs).

use lbscale_engine::cloud::{CloudError, Result};

pub use roxmltree::{Document, Node};

/// Parses an answer of `what`; a body that is not XML is an error naming the call.
pub fn parse<'a>(what: &str, text: &'a str) -> Result<Document<'a>> {
    Document::parse(text).map_err(|e| {
        CloudError::Failed(format!(
            "AWS {what}: the answer is not XML ({e}): {}",
            text.chars().take(200).collect::<String>()
        ))
    })
}

/// The first element named `name` at or under `node`.
pub fn find<'a, 'i>(node: Node<'a, 'i>, name: &str) -> Option<Node<'a, 'i>> {
    node.descendants()
        .find(|n| n.is_element() && n.tag_name().name() == name)
}

/// Every element named `name` at or under `node`, in document order.
pub fn find_all<'a, 'i>(
    node: Node<'a, 'i>,
    name: &'a str,
) -> impl Iterator<Item = Node<'a, 'i>> + 'a {
    node.descendants()
        .filter(move |n| n.is_element() && n.tag_name().name() == name)
}

/// The text of the first element named `name` under `node`.
pub fn text(node: Node<'_, '_>, name: &str) -> Option<String> {
    find(node, name).map(|n| n.text().unwrap_or("").trim().to_string())
}

/// The text of a direct child named `name` (where the same name also appears
/// deeper, as an instance's `privateIpAddress` does in its network interfaces).
pub fn child_text(node: Node<'_, '_>, name: &str) -> Option<String> {
    node.children()
        .find(|n| n.is_element() && n.tag_name().name() == name)
        .map(|n| n.text().unwrap_or("").trim().to_string())
}

/// AWS's error code and message in an error answer (`<Error><Code>` in every
/// API's envelope).
pub fn error_code_and_message(text: &str) -> Option<(String, String)> {
    let doc = Document::parse(text).ok()?;
    if let Some(err) = find(doc.root(), "Error") {
        return Some((
            text_of(err, "Code")?,
            text_of(err, "Message").unwrap_or_default(),
        ));
    }
    // Route 53's InvalidChangeBatch: the root names the error, and each
    // reason is a <Message>.
    let root = doc.root_element();
    let messages: Vec<String> = find_all(root, "Message")
        .filter_map(|m| m.text().map(|t| t.trim().to_string()))
        .collect();
    (!messages.is_empty()).then(|| (root.tag_name().name().to_string(), messages.join("; ")))
}

fn text_of(node: Node<'_, '_>, name: &str) -> Option<String> {
    text(node, name)
}

/// Escapes text for an XML body.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_envelopes_of_each_api() {
        let ec2 = r#"<?xml version="1.0"?><Response><Errors><Error><Code>InvalidAMIID.NotFound</Code><Message>The image id '[ami-x]' does not exist</Message></Error></Errors><RequestID>r</RequestID></Response>"#;
        assert_eq!(
            error_code_and_message(ec2),
            Some((
                "InvalidAMIID.NotFound".into(),
                "The image id '[ami-x]' does not exist".into()
            ))
        );
        let route53 = r#"<ErrorResponse xmlns="https://route53.amazonaws.com/doc/2013-04-01/"><Error><Type>Sender</Type><Code>NoSuchHostedZone</Code><Message>No hosted zone found</Message></Error></ErrorResponse>"#;
        assert_eq!(
            error_code_and_message(route53).map(|c| c.0),
            Some("NoSuchHostedZone".into())
        );
        assert_eq!(error_code_and_message("<html>bad gateway</html>"), None);
        let batch = r#"<?xml version="1.0" encoding="UTF-8"?><InvalidChangeBatch xmlns="https://route53.amazonaws.com/doc/2013-04-01/"><Messages><Message>Tried to delete resource record set [name='a.example.com.', type='A'] but it was not found</Message></Messages></InvalidChangeBatch>"#;
        let (code, message) = error_code_and_message(batch).unwrap();
        assert_eq!(code, "InvalidChangeBatch");
        assert!(message.contains("was not found"), "{message}");
        assert_eq!(escape("a<b&\"c\">"), "a&lt;b&amp;&quot;c&quot;&gt;");
    }
}
