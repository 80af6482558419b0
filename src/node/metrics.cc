#include "node/metrics.h"

#include <charconv>
#include <cmath>
#include <cstdint>

namespace kvstash::node {
namespace {

bool is_alpha_or_underscore(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

bool valid_metric_name(std::string_view s) {
  if (s.empty()) return false;
  if (!is_alpha_or_underscore(s[0]) && s[0] != ':') return false;
  for (char c : s) {
    if (!is_alpha_or_underscore(c) && !is_digit(c) && c != ':') return false;
  }
  return true;
}

bool valid_label_name(std::string_view s) {
  if (s.empty() || !is_alpha_or_underscore(s[0]) || s.starts_with("__")) return false;
  for (char c : s) {
    if (!is_alpha_or_underscore(c) && !is_digit(c)) return false;
  }
  return true;
}

// HELP text escapes backslash and newline; label values also escape the double quote that
// would otherwise end them.
void append_escaped(std::string& out, std::string_view s, bool quote) {
  for (char c : s) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '"': out += quote ? "\\\"" : "\""; break;
      default: out += c;
    }
  }
}

// Integral values print without a fraction so counters read as counts; the rest use the
// shortest text that parses back to the same double.
void append_value(std::string& out, double v) {
  if (std::isnan(v)) {
    out += "NaN";
    return;
  }
  if (std::isinf(v)) {
    out += v > 0 ? "+Inf" : "-Inf";
    return;
  }
  char buf[32];
  std::to_chars_result r;
  // 2^63 bounds what an int64 holds; every double that large is integral anyway.
  if (v == std::trunc(v) && v >= -9223372036854775808.0 && v < 9223372036854775808.0) {
    r = std::to_chars(buf, buf + sizeof buf, static_cast<std::int64_t>(v));
  } else {
    r = std::to_chars(buf, buf + sizeof buf, v);
  }
  out.append(buf, r.ptr);
}

}  // namespace

void MetricsText::counter(std::string_view name, std::string_view help, double value, Labels labels) {
  add("counter", name, help, value, labels);
}

void MetricsText::gauge(std::string_view name, std::string_view help, double value, Labels labels) {
  add("gauge", name, help, value, labels);
}

void MetricsText::add(std::string_view type, std::string_view name, std::string_view help, double value,
                      Labels labels) {
  if (!valid_metric_name(name)) return;
  for (auto it = labels.begin(); it != labels.end(); ++it) {
    if (!valid_label_name(it->first)) return;
    for (auto prev = labels.begin(); prev != it; ++prev) {
      if (prev->first == it->first) return;
    }
  }
  Family* family = nullptr;
  for (auto& f : families_) {
    if (f.name == name) family = &f;
  }
  if (family == nullptr) {
    family = &families_.emplace_back();
    family->name = std::string(name);
    append_escaped(family->help, help, false);
    family->type = type;
  } else if (family->type != type) {
    return;
  }

  std::string& out = family->samples;
  out += name;
  if (labels.size() != 0) {
    out += '{';
    bool first = true;
    for (const auto& [label, label_value] : labels) {
      if (!first) out += ',';
      first = false;
      out += label;
      out += "=\"";
      append_escaped(out, label_value, true);
      out += '"';
    }
    out += '}';
  }
  out += ' ';
  append_value(out, value);
  out += '\n';
}

std::string MetricsText::str() const {
  std::string out;
  for (const auto& f : families_) {
    out += "# HELP ";
    out += f.name;
    if (!f.help.empty()) {
      out += ' ';
      out += f.help;
    }
    out += "\n# TYPE ";
    out += f.name;
    out += ' ';
    out += f.type;
    out += '\n';
    out += f.samples;
  }
  return out;
}

}  // namespace kvstash::node
