"""Every message lanes puts on the wire, as msgspec Structs.

All structs are frozen and tagged (`kind`) and carry a `schema` version, so a
reader can tell what it holds before trusting it. New fields must get
defaults; a field's type never changes (see docs/schemas/).

This package re-exports nothing: import each name from the module that defines it.

| module   | holds |
|----------|-------|
| wire     | SCHEMA_VERSION, the bounded field types (Bytes, Name, Text, FEW ...), Message, encode, decode |
| hosts    | what a host has: GpuInfo, ServerCaps, ModelFacts, AdapterFacts, HostReport |
| config   | fleet intent: FleetConfig, Persona, Demand, the lane log limits |
| plans    | the plan: DeviceMemory, MemoryBreakdown, LaneLayout, LaneSpec, HostPlan, FleetPlan |
| status   | what runs: LaneStatus, LaneFeedback, HostStatus, LaneLoad, HostLoad, LaneEvent, PlanRejected, LaneSecret, SessionSecret |
| replies  | the planner's requests and replies: ConfigSet, HostQuery, ErrorReply, FleetHosts, FleetStatus |
| activity | models on demand: ModelWake, GatewayActivity, TenantUsage, ModelStates, PlannerLease |
| prefixes | the shared prefix view: PrefixEvent |
| catalog  | WIRE_TYPES (one JSON Schema each) and every struct of the package |
"""
