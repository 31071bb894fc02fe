#include "common/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace outbox {

Counter* Metrics::AddCounter(const std::string& name, const std::string& help) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = entries_[name];
  if (e.counter == nullptr) {
    e.help = help;
    e.type = "counter";
    e.counter = std::make_unique<Counter>();
  }
  return e.counter.get();
}

void Metrics::AddGauge(const std::string& name, const std::string& help,
                       std::function<double()> read) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = entries_[name];
  e.help = help;
  e.type = "gauge";
  e.gauge = std::move(read);
}

std::string Metrics::Render() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  std::string last_family;
  for (const auto& [name, e] : entries_) {
    std::string family = name.substr(0, name.find('{'));
    if (family != last_family) {
      absl::StrAppend(&out, "# HELP ", family, " ", e.help, "\n# TYPE ",
                      family, " ", e.type, "\n");
      last_family = family;
    }
    if (e.counter != nullptr) {
      absl::StrAppend(&out, name, " ", e.counter->value(), "\n");
    } else {
      absl::StrAppend(&out, name, " ", e.gauge(), "\n");
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen, const Metrics* metrics) {
  size_t colon = listen.rfind(':');
  int port = 0;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen: \"", listen, "\" is not host:port"));
  }
  std::string host = listen.substr(0, colon);
  if (host.empty() || host == "0.0.0.0" || host == "*") host = "0.0.0.0";
  if (host == "localhost") host = "127.0.0.1";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_listen: \"", host, "\" is not an IPv4 address"));
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(fd, 16) != 0) {
    std::string err = std::strerror(errno);
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("--metrics_listen: cannot listen on ", listen, ": ", err));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return std::unique_ptr<MetricsHttpServer>(
      new MetricsHttpServer(fd, ntohs(addr.sin_port), metrics));
}

MetricsHttpServer::MetricsHttpServer(int fd, int port, const Metrics* metrics)
    : fd_(fd), port_(port), metrics_(metrics), thread_([this] { Loop(); }) {}

MetricsHttpServer::~MetricsHttpServer() {
  stop_ = true;
  thread_.join();
  close(fd_);
}

void MetricsHttpServer::Loop() {
  while (!stop_) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, 200) <= 0) continue;
    int client = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    timeval tv{2, 0};
    setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(client, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    char buf[2048];
    std::string request;
    while (request.find("\r\n\r\n") == std::string::npos &&
           request.size() < 16384) {
      ssize_t n = recv(client, buf, sizeof(buf), 0);
      if (n <= 0) break;
      request.append(buf, static_cast<size_t>(n));
    }
    std::string status = "200 OK";
    std::string body;
    std::string type = "text/plain; version=0.0.4; charset=utf-8";
    if (request.rfind("GET /metrics", 0) == 0) {
      body = metrics_->Render();
    } else if (request.rfind("GET /healthz", 0) == 0) {
      body = "ok\n";
    } else {
      status = "404 Not Found";
      body = "try GET /metrics\n";
    }
    std::string response =
        absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type,
                     "\r\nContent-Length: ", body.size(),
                     "\r\nConnection: close\r\n\r\n", body);
    size_t off = 0;
    while (off < response.size()) {
      ssize_t n = send(client, response.data() + off, response.size() - off,
                       MSG_NOSIGNAL);
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
    close(client);
  }
}

}  // namespace outbox
