//! Settings of the rewriting pipeline (`[pipeline]` in config.toml), with the numbers the
//! product was designed with as defaults.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Rewrite and send the smaller request.
    Optimize,
    /// Compute and report everything, send the original request.
    Observe,
    /// Do nothing.
    Off,
}

impl Mode {
    pub fn parse(value: &str) -> Option<Mode> {
        match value.trim().to_ascii_lowercase().as_str() {
            "optimize" => Some(Mode::Optimize),
            "observe" => Some(Mode::Observe),
            "off" => Some(Mode::Off),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Optimize => "optimize",
            Mode::Observe => "observe",
            Mode::Off => "off",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PipelineConfig {
    pub mode: Mode,
    /// A conversation's rewrite changes what was already sent (window moved, results cleared,
    /// summary rebuilt) only when that removes at least this many tokens; between such
    /// recompactions new messages are appended after the previous rewrite (`prefix.rs`).
    /// 0: every request is rewritten whole.
    pub clear_at_least_tokens: usize,
    /// How long the store remembers where a conversation's rewrite was last rebuilt.
    pub prefix_ttl_secs: u64,
    pub system: SystemConfig,
    pub window: WindowConfig,
    pub facts: FactsConfig,
    pub compact: CompactConfig,
    pub budget: BudgetConfig,
    /// Read from the top-level `[tools]` section (see `Config`).
    #[serde(skip)]
    pub tools: ToolsConfig,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            mode: Mode::Optimize,
            clear_at_least_tokens: 1000,
            prefix_ttl_secs: 3600,
            system: SystemConfig::default(),
            window: WindowConfig::default(),
            facts: FactsConfig::default(),
            compact: CompactConfig::default(),
            budget: BudgetConfig::default(),
            tools: ToolsConfig::default(),
        }
    }
}

/// The most re-asks `[tools] max_expansions` may allow (each one is an upstream call).
const MAX_EXPANSIONS: u32 = 8;

/// `[tools]`: tool filtering by category.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolsConfig {
    pub enabled: bool,
    /// Tool definitions totalling fewer tokens than this are sent whole, unfiltered.
    pub min_tool_tokens: usize,
    /// `[[tools.categories]]`: named groups of tools with the words that call for them.
    pub categories: Vec<ToolCategory>,
    /// Tools (names or `*` globs) never filtered.
    pub always: Vec<String>,
    /// Keep tools whose name is a single word (`think`, `calculate`, `Finish`): agent
    /// utilities a user never names, and small.
    pub keep_single_word_tools: bool,
    /// When no category matches and the conversation has no sticky categories.
    pub on_no_match: OnNoMatch,
    /// What becomes of a tool the stage leaves out: a stub (name, first sentence, no
    /// parameters; a call to it is re-asked with the full definition) or nothing.
    pub left_out: LeftOut,
    /// Cap of a stub's description.
    pub stub_description_tokens: usize,
    /// A tool whose definition is shorter than this goes in full: its stub would save little,
    /// and a call to a stub costs a re-ask.
    pub min_stub_tokens: usize,
    /// Re-asks of one request whose answer called stubs; past them, every tool goes in full.
    pub max_expansions: u32,
    /// Earlier turns read as context, and the characters read of each of their messages.
    pub context_turns: usize,
    pub context_chars: usize,
    /// Weight of a keyword found in the context (one in the current message weighs 1).
    pub context_weight: f64,
    /// Score a category needs to be selected.
    pub min_score: f64,
    /// A name-derived category holding more tools than this is split by the tools' last name
    /// segment (`github_list_issues` → `github.issue`).
    pub derived_max_tools: usize,
    /// How long a conversation's sticky categories live without a new tool-using turn.
    pub sticky_ttl_secs: u64,
    /// Where a tool needed after the block was decided gets its definition: set per upstream
    /// (`[upstream]`/`[[routes]] tool_definitions`), not read from `[tools]`.
    #[serde(skip)]
    pub definitions: Definitions,
}

/// Where the full definition of a tool needed later goes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Definitions {
    /// In place where `auto` finds a provider known to read a mid-conversation system message
    /// (OpenAI), else as a call's result.
    #[default]
    Auto,
    /// A system message where the need arose: the block stays the same bytes.
    InPlace,
    /// The tool grows in the block, in full: every chat template reads it, at the cost of one
    /// prefix change per growth.
    InBlock,
    /// The result of a call of the stub where the need arose (an assistant message calling it
    /// with `{}`, then a tool message with the definition): the block stays the same bytes,
    /// and every chat template that renders tool calls reads it.
    InResult,
}

impl Definitions {
    /// `auto` resolved for an upstream's base URL: in place for OpenAI and Azure OpenAI, as a
    /// call's result for any other (a chat template may refuse or drop a system message in
    /// mid-conversation; all that render tool calls render a call and its result).
    pub fn for_base_url(self, base_url: &str) -> Definitions {
        if self != Definitions::Auto {
            return self;
        }
        let host = base_url
            .split("://")
            .nth(1)
            .unwrap_or(base_url)
            .split(['/', ':'])
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase();
        if host == "api.openai.com" || host.ends_with(".openai.azure.com") {
            Definitions::InPlace
        } else {
            Definitions::InResult
        }
    }

    /// As the config says it.
    pub fn as_str(self) -> &'static str {
        match self {
            Definitions::Auto => "auto",
            Definitions::InPlace => "in_place",
            Definitions::InBlock => "in_block",
            Definitions::InResult => "in_result",
        }
    }

    /// Whether a tool needed later grows in the block (a request that was never resolved
    /// against an upstream, as in `analyze`, reads `auto` as in place).
    pub fn in_block(self) -> bool {
        self == Definitions::InBlock
    }
}

impl Default for ToolsConfig {
    fn default() -> Self {
        ToolsConfig {
            enabled: true,
            min_tool_tokens: 1_000,
            categories: Vec::new(),
            always: Vec::new(),
            keep_single_word_tools: true,
            on_no_match: OnNoMatch::Stub,
            left_out: LeftOut::Stub,
            stub_description_tokens: 24,
            min_stub_tokens: 150,
            max_expansions: 2,
            context_turns: 3,
            context_chars: 150,
            context_weight: 0.3,
            min_score: 2.0,
            derived_max_tools: 8,
            sticky_ttl_secs: 3600,
            definitions: Definitions::Auto,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolCategory {
    pub name: String,
    /// Words or phrases, any language; matched case- and accent-insensitively.
    pub keywords: Vec<String>,
    /// Tool names or `*` globs.
    pub tools: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnNoMatch {
    /// Select nothing: every tool not protected is left out (see `left_out`).
    Stub,
    /// Send no tools but the protected ones: the answer is text.
    DropAll,
    /// Send every tool.
    KeepAll,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LeftOut {
    /// Sent as a stub: still callable.
    Stub,
    /// Not sent.
    Remove,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SystemConfig {
    pub enabled: bool,
}

impl Default for SystemConfig {
    fn default() -> Self {
        SystemConfig { enabled: true }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WindowConfig {
    pub enabled: bool,
    /// Turns kept verbatim by default, and the adaptive bounds.
    pub turns: usize,
    pub min_turns: usize,
    pub max_turns: usize,
    /// Older turns are summarized in segments of this many turns…
    pub segment_turns: usize,
    /// …keeping at most this many segment summaries, each at most this many tokens.
    pub max_segments: usize,
    pub segment_max_tokens: usize,
    /// Cap of the verbatim window, in tokens (after compaction).
    pub max_tokens: usize,
    /// Lexical continuity of recent user messages (cosine of word counts) above which the
    /// window grows to `max_turns`, and below which it shrinks to `min_turns`.
    pub continuity_high: f64,
    pub continuity_low: f64,
    /// A user message this dissimilar to the previous one starts a new topic.
    pub topic_shift_similarity: f64,
    /// The agent's latest tool calls after the last user message that are kept whole, with
    /// their results (part of the working set, never cut).
    pub recent_tool_steps: usize,
    /// Cap of the ledger: the identifiers of summarized turns, word for word.
    pub ledger_max_tokens: usize,
}

impl Default for WindowConfig {
    fn default() -> Self {
        WindowConfig {
            enabled: true,
            turns: 3,
            min_turns: 2,
            max_turns: 4,
            segment_turns: 3,
            max_segments: 4,
            segment_max_tokens: 50,
            max_tokens: 1200,
            continuity_high: 0.35,
            continuity_low: 0.05,
            topic_shift_similarity: 0.02,
            recent_tool_steps: 4,
            ledger_max_tokens: 600,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FactsConfig {
    pub enabled: bool,
    /// Cap of the `<user_facts>` section (50–150 tokens).
    pub max_tokens: usize,
}

impl Default for FactsConfig {
    fn default() -> Self {
        FactsConfig {
            enabled: true,
            max_tokens: 150,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CompactConfig {
    pub enabled: bool,
    /// Tool results larger than this are compacted.
    pub tool_result_max_tokens: usize,
    /// Tool results older than the last N (and outside the working set) are replaced by a stub
    /// listing the identifiers they held.
    pub keep_recent_results: usize,
    /// Cap of such a stub.
    pub stub_max_tokens: usize,
    /// Older results are cleared in batches of at least this many tokens, so that the prompt's
    /// already-sent start changes only when it pays (the provider's prompt cache); 0 clears
    /// each result as soon as it is old enough.
    pub clear_at_least_tokens: usize,
    /// Prose strings longer than this are shortened (identifiers never are).
    pub max_string_chars: usize,
    /// Fields kept from JSON objects when they have any of them.
    pub keep_fields: Vec<String>,
    /// Extra fields to keep, by tool name.
    pub tool_fields: std::collections::BTreeMap<String, Vec<String>>,
    /// A result cleared or cut names a handle, and a request with tools offers
    /// `ctxproxy_recall`: the proxy answers a call with the original, unseen by the client.
    pub recall: bool,
}

impl Default for CompactConfig {
    fn default() -> Self {
        let keep = [
            "name",
            "full_name",
            "id",
            "title",
            "description",
            "url",
            "html_url",
            "state",
            "number",
            "created_at",
            "updated_at",
            "language",
            "login",
            "sha",
            "status",
            "type",
            "email",
            "path",
            "message",
            "body",
            "error",
            "code",
            "stargazers_count",
            "private",
        ];
        CompactConfig {
            enabled: true,
            tool_result_max_tokens: 1000,
            keep_recent_results: 2,
            stub_max_tokens: 200,
            clear_at_least_tokens: 2000,
            max_string_chars: 300,
            keep_fields: keep.iter().map(|s| (*s).to_owned()).collect(),
            tool_fields: std::collections::BTreeMap::new(),
            recall: true,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnExceed {
    /// Refuse with 400 `context_budget_exceeded`.
    Reject,
    /// Send the best effort anyway: the floor (system, tools, working set, ledger), flagged
    /// with `X-Ctxproxy-Over-Budget` and counted.
    Forward,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BudgetConfig {
    pub enabled: bool,
    /// Hard cap of a request: messages plus tool definitions.
    pub max_tokens: usize,
    pub on_exceed: OnExceed,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        BudgetConfig {
            enabled: true,
            max_tokens: 4000,
            on_exceed: OnExceed::Forward,
        }
    }
}

impl PipelineConfig {
    /// Checks relations between values; returns the offending key and why.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let w = &self.window;
        let err = |key: &str, message: &str| Err((format!("pipeline.{key}"), message.to_owned()));
        if w.min_turns == 0 || w.min_turns > w.turns || w.turns > w.max_turns {
            return err("window", "expected 1 <= min_turns <= turns <= max_turns");
        }
        if w.segment_turns == 0 {
            return err("window.segment_turns", "must be greater than 0");
        }
        if !(0.0..=1.0).contains(&w.continuity_low) || !(0.0..=1.0).contains(&w.continuity_high) {
            return err("window", "continuity thresholds must be between 0 and 1");
        }
        if w.continuity_low > w.continuity_high {
            return err(
                "window.continuity_low",
                "must not be greater than window.continuity_high",
            );
        }
        if self.prefix_ttl_secs == 0 {
            return err("prefix_ttl_secs", "must be greater than 0");
        }
        if self.budget.max_tokens == 0 {
            return err("budget.max_tokens", "must be greater than 0");
        }
        let tools = &self.tools;
        let tools_err =
            |key: &str, message: &str| Err((format!("tools.{key}"), message.to_owned()));
        let mut names = std::collections::HashSet::new();
        for category in &tools.categories {
            if category.name.trim().is_empty() || category.tools.is_empty() {
                return tools_err(
                    "categories",
                    "every category needs a name and at least one tool",
                );
            }
            if !names.insert(category.name.as_str()) {
                return tools_err(
                    "categories",
                    &format!("category `{}` is defined twice", category.name),
                );
            }
            if category.keywords.is_empty() || category.keywords.iter().any(|k| k.trim().is_empty())
            {
                return tools_err(
                    "categories",
                    &format!("category `{}` needs non-empty keywords", category.name),
                );
            }
        }
        if tools.always.iter().any(|t| t.trim().is_empty()) {
            return tools_err("always", "tool names must not be empty");
        }
        if !(tools.min_score.is_finite() && tools.min_score > 0.0) {
            return tools_err("min_score", "must be a number greater than 0");
        }
        if !(tools.context_weight.is_finite() && tools.context_weight >= 0.0) {
            return tools_err("context_weight", "must be a number of at least 0");
        }
        if !(1..=MAX_EXPANSIONS).contains(&tools.max_expansions) {
            return tools_err(
                "max_expansions",
                &format!("must be between 1 and {MAX_EXPANSIONS}"),
            );
        }
        if tools.sticky_ttl_secs == 0 {
            return tools_err("sticky_ttl_secs", "must be greater than 0");
        }
        if self.compact.tool_result_max_tokens == 0 {
            return err("compact.tool_result_max_tokens", "must be greater than 0");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_definitions_are_in_place_for_openai_and_results_elsewhere() {
        let auto = Definitions::Auto;
        assert_eq!(
            auto.for_base_url("https://api.openai.com/v1"),
            Definitions::InPlace
        );
        assert_eq!(
            auto.for_base_url("https://acme.openai.azure.com/openai/deployments/x"),
            Definitions::InPlace
        );
        for other in [
            "http://127.0.0.1:8000/v1",
            "https://api.mistral.ai/v1",
            "http://vllm:8000/v1",
            "https://api.openai.com.evil.example/v1",
        ] {
            assert_eq!(auto.for_base_url(other), Definitions::InResult, "{other}");
        }
        // A placement set by hand is kept.
        assert_eq!(
            Definitions::InPlace.for_base_url("http://127.0.0.1/v1"),
            Definitions::InPlace
        );
    }
}
