// The registry a Store keeps its metrics in (Store::metrics_text), for the parts of the
// library that count into it too: its KvCaches.
#pragma once

#include "common/metrics.h"
#include "kvstash/store.h"

namespace kvstash {

metrics::Registry& store_metrics(Store& store);

}  // namespace kvstash
