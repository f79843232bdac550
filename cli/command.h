// Subcommand registry of the `deltamoe` CLI. Each cli/<name>.cpp registers one subcommand with a
// static Registrar; main.cpp only builds the App from the registry. Subcommands parse arguments
// and call the library; no model logic lives here.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace dm::cli {

struct Command {
  std::string name;
  std::string help;
  // Adds options to `app` and sets its callback. Errors are thrown as dm::Error.
  std::function<void(CLI::App* app)> setup;
};

std::vector<Command>& registry();

struct Registrar {
  Registrar(std::string name, std::string help, std::function<void(CLI::App*)> setup) {
    registry().push_back({std::move(name), std::move(help), std::move(setup)});
  }
};

}  // namespace dm::cli
