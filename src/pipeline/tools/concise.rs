//! A tool in full, as the stage sends it: the client's definition without the schema titles
//! that only restate a name. pydantic writes one for every property (`"title": "Order Id"` on
//! `order_id`), for every model under `$defs` (`"title": "Address"` on `Address`), and for the
//! arguments model itself (`"title": "parameters"`, `"get_weatherArguments"`): on tau2's tools
//! about a tenth of their tokens. LangChain's tool conversion drops them the same way. A title
//! that says anything else is kept, and so is every other keyword: what a model or a validator
//! reads of the schema is unchanged.

use serde_json::{Map, Value};

use crate::openai::{Nullable, Tool};
use crate::pipeline::text::name_segments;

/// The keywords whose value maps names to schemas: a schema under them is named by its key.
const NAMED_SCHEMAS: [&str; 3] = ["properties", "$defs", "definitions"];
/// The keywords whose value is data, not schemas: left as they are.
const DATA: [&str; 5] = ["default", "examples", "example", "const", "enum"];
/// Words a root title adds to the function's name: `get_weatherArguments`, `parameters`.
const ROOT_SUFFIXES: [&str; 6] = [
    "arguments",
    "args",
    "parameters",
    "params",
    "input",
    "schema",
];

/// `tool` with its parameters' restating titles left out; the same tool (its schema shared)
/// when it has none.
pub fn concise(tool: &Tool) -> Tool {
    let Some(function) = &tool.function else {
        return tool.clone();
    };
    let Some(schema) = function.parameters.get() else {
        return tool.clone();
    };
    let name = &function.name;
    let Some(parameters) = schema.concise(name, |schema| without_restating_titles(schema, name))
    else {
        return tool.clone();
    };
    let mut tool = tool.clone();
    if let Some(function) = tool.function.as_mut() {
        function.parameters = Nullable::Value(parameters);
    }
    tool
}

/// The arguments schema of the function `name` without the titles that restate a name; `None`
/// when it has none.
fn without_restating_titles(schema: &Value, name: &str) -> Option<Value> {
    let mut changed = false;
    let root = |title: &str| {
        let mut words = words(title);
        if words
            .last()
            .is_some_and(|w| ROOT_SUFFIXES.contains(&w.as_str()))
        {
            words.pop();
        }
        words.is_empty() || words == self::words(name)
    };
    let concise = walk(schema, &root, &mut changed);
    changed.then_some(concise)
}

/// `schema` without the titles `restates` says only restate its name, in its subschemas too.
fn walk(schema: &Value, restates: &dyn Fn(&str) -> bool, changed: &mut bool) -> Value {
    match schema {
        Value::Object(object) => {
            let mut out = Map::with_capacity(object.len());
            for (key, value) in object {
                match (key.as_str(), value) {
                    ("title", Value::String(title)) if restates(title) => *changed = true,
                    (data, _) if DATA.contains(&data) => {
                        out.insert(key.clone(), value.clone());
                    }
                    (named, Value::Object(schemas)) if NAMED_SCHEMAS.contains(&named) => {
                        let schemas = schemas.iter().map(|(name, schema)| {
                            let restates = |title: &str| words(title) == words(name);
                            (name.clone(), walk(schema, &restates, changed))
                        });
                        out.insert(key.clone(), Value::Object(schemas.collect()));
                    }
                    _ => {
                        out.insert(key.clone(), walk(value, &|_| false, changed));
                    }
                }
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(
            items
                .iter()
                .map(|item| walk(item, &|_| false, changed))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// The words of a name or title, lowercase: `order_id`, `orderId`, `Order Id` and `ORDER-ID`
/// are all `order id`.
fn words(text: &str) -> Vec<String> {
    name_segments(text)
        .into_iter()
        .map(str::to_lowercase)
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;

    use super::*;

    fn tool(name: &str, parameters: Value) -> Tool {
        serde_json::from_value(json!({"type": "function", "function": {"name": name,
            "description": "Does it.", "parameters": parameters}}))
        .unwrap()
    }

    fn parameters(tool: &Tool) -> Value {
        tool.function
            .as_ref()
            .unwrap()
            .parameters
            .get()
            .unwrap()
            .value()
            .clone()
    }

    #[test]
    fn titles_that_restate_a_property_model_or_the_function_are_left_out() {
        let pydantic = tool(
            "get_order_details",
            json!({"properties": {
                "order_id": {"description": "The order id, such as '#W0000000'.",
                    "title": "Order Id", "type": "string"},
                "address": {"$ref": "#/$defs/Address"}},
                "$defs": {"Address": {"title": "Address", "type": "object",
                    "properties": {"zip": {"title": "Zip", "type": "string"}}}},
                "required": ["order_id"], "title": "parameters", "type": "object"}),
        );
        assert_eq!(
            parameters(&concise(&pydantic)),
            json!({"properties": {
                "order_id": {"description": "The order id, such as '#W0000000'.",
                    "type": "string"},
                "address": {"$ref": "#/$defs/Address"}},
                "$defs": {"Address": {"type": "object",
                    "properties": {"zip": {"type": "string"}}}},
                "required": ["order_id"], "type": "object"})
        );
        let fastmcp = tool(
            "get_weather",
            json!({"title": "get_weatherArguments", "type": "object",
                "properties": {"cityName": {"title": "City Name", "type": "string"}}}),
        );
        assert_eq!(
            parameters(&concise(&fastmcp)),
            json!({"type": "object", "properties": {"cityName": {"type": "string"}}})
        );
    }

    #[test]
    fn a_title_that_says_more_than_a_name_and_a_property_named_title_stay() {
        let schema = json!({"title": "Search the catalog", "type": "object", "properties": {
            "title": {"title": "Title", "type": "string"},
            "q": {"title": "Words to look for", "type": "string"},
            "items": {"type": "array", "items": {"title": "Items", "type": "string"}}},
            "required": ["title"]});
        let searched = concise(&tool("search", schema));
        assert_eq!(
            parameters(&searched),
            json!({"title": "Search the catalog", "type": "object", "properties": {
                "title": {"type": "string"},
                "q": {"title": "Words to look for", "type": "string"},
                "items": {"type": "array", "items": {"title": "Items", "type": "string"}}},
                "required": ["title"]})
        );
    }

    #[test]
    fn data_in_a_schema_is_left_as_it_is() {
        let schema = json!({"type": "object", "properties": {"filter": {"type": "object",
            "default": {"properties": {"x": {"title": "X"}}},
            "examples": [{"title": "Title"}]}}});
        assert_eq!(
            concise(&tool("query", schema.clone())),
            tool("query", schema)
        );
    }

    #[test]
    fn the_concise_form_of_a_shared_schema_is_made_for_each_name() {
        let schema = json!({"title": "lookup_arguments", "type": "object"});
        let lookup = tool("lookup", schema.clone());
        assert_eq!(parameters(&concise(&lookup)), json!({"type": "object"}));
        // The same schema under another name: its root title says something of its own.
        let mut renamed = lookup.clone();
        renamed.function.as_mut().unwrap().name = "search".to_owned();
        assert_eq!(parameters(&concise(&renamed)), schema);
        assert_eq!(parameters(&concise(&lookup)), json!({"type": "object"}));
    }

    #[test]
    fn a_tool_with_nothing_to_leave_out_is_the_same_tool() {
        let plain = tool(
            "lookup",
            json!({"type": "object", "properties": {"id": {"type": "string"}}}),
        );
        let same = concise(&plain);
        assert_eq!(same, plain);
        assert!(Arc::ptr_eq(
            same.function.as_ref().unwrap().parameters.get().unwrap(),
            plain.function.as_ref().unwrap().parameters.get().unwrap()
        ));
    }

    #[test]
    fn words_fold_case_and_separators() {
        assert_eq!(words("order_id"), ["order", "id"]);
        assert_eq!(words("orderId"), ["order", "id"]);
        assert_eq!(words("Order Id"), ["order", "id"]);
        assert_eq!(words("ORDER-ID"), ["order", "id"]);
        assert_eq!(
            words("get_weatherArguments"),
            ["get", "weather", "arguments"]
        );
    }
}
