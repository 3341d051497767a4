//! The guards' decisions on a whole JSON answer, whichever API it speaks: one entry point over
//! chat's ([`json`]) and the Responses API's ([`responses_json`]).

use std::borrow::Cow;

use serde_json::Value;

use super::json::{self, Appended};
use super::{continuation, responses_json};
use crate::openai::Api;

/// The decisions on a whole answer of either API: a chat completion's ([`json`]) or a
/// Response's ([`responses_json`]).
#[derive(Debug, Clone, Copy)]
pub struct Decisions(pub Api);

impl Decisions {
    pub fn is_cut(self, answer: &Value) -> bool {
        match self.0 {
            Api::Chat => json::is_cut(answer),
            Api::Responses => responses_json::is_cut(answer),
        }
    }

    pub fn continuation_request(
        self,
        answer: &Value,
        sent: &[u8],
        instruction: &str,
    ) -> Option<Vec<u8>> {
        match self.0 {
            Api::Chat => json::continuation_request(answer, sent, instruction),
            Api::Responses => responses_json::continuation_request(answer, sent, instruction),
        }
    }

    pub fn append(self, answer: &mut Value, next: &Value) -> Appended {
        match self.0 {
            Api::Chat => json::append(answer, next),
            Api::Responses => responses_json::append(answer, next),
        }
    }

    pub fn claim<'a>(self, answer: &'a Value, patterns: &[String]) -> Option<Cow<'a, str>> {
        match self.0 {
            Api::Chat => json::claim(answer, patterns).map(Cow::Borrowed),
            Api::Responses => responses_json::claim(answer, patterns).map(Cow::Owned),
        }
    }

    /// The retry request; `tools`: the client's, in the API's own form.
    pub fn retry_request(
        self,
        sent: &[u8],
        claim: &str,
        note: &str,
        tools: Option<&Value>,
    ) -> Option<Vec<u8>> {
        match self.0 {
            Api::Chat => continuation::retry_body(sent, claim, note, tools),
            Api::Responses => responses_json::retry_request(sent, claim, note, tools),
        }
    }

    pub fn calls_a_tool(self, retry: &Value) -> bool {
        match self.0 {
            Api::Chat => json::calls_a_tool(retry),
            Api::Responses => responses_json::calls_a_tool(retry),
        }
    }

    pub fn repaired(self, answer: &Value, retry: Value) -> Value {
        match self.0 {
            Api::Chat => json::repaired(answer, retry),
            Api::Responses => responses_json::repaired(answer, retry),
        }
    }
}
